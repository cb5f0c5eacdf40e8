"""gdn-layer: a drop-in GatedDeltaNet block for long-context training."""
__version__ = "0.1.0"
