"""gdn-layer: a drop-in GatedDeltaNet block for long-context training.

``from gdn_layer import GatedDeltaNet, GDNState``; kernels in ``gdn_layer.kernels``, Ulysses in
``gdn_layer.parallel``, the transformers adapter in ``gdn_layer.hf``;
``make_graphed_layers`` puts each layer of a model in its own CUDA graph (gdn_layer/graphed.py);
``DecodeGraph`` replays one layer's decode step over its state pool (gdn_layer/decode_graph.py).
"""
from gdn_layer.decode_graph import DecodeGraph
from gdn_layer.graphed import count_replays, make_graphed_layers, release_graphed_layers
from gdn_layer.layer import GatedDeltaNet
from gdn_layer.state import GDNState

__version__ = "0.1.0"
__all__ = ["GatedDeltaNet", "GDNState", "DecodeGraph", "make_graphed_layers", "release_graphed_layers", "count_replays"]
