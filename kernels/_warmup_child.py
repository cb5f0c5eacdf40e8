"""Entry point of ``warmup()``'s child processes: ``python -m gdn_layer.kernels._warmup_child`` reads a
layer spec and its share of the warmup calls (JSON) from stdin and runs them (see ``warmup.py``)."""
from gdn_layer.kernels.warmup import _child_main

if __name__ == "__main__":
    _child_main()
