"""The math of the GatedDeltaNet block behind one backend registry.

``from gdn_layer.kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule, causal_conv1d``.
"""

# Run from the repository root, this source folder is importable as a top-level ``kernels`` too, the
# name of PyPI's Hugging Face kernel hub, which transformers probes (and imports) at start-up. Imported
# under that name it must define nothing: a second import would register the custom ops again.
if __name__ == "gdn_layer.kernels":
    from .api import (causal_conv1d, causal_conv1d_gate, causal_conv1d_split, chunk_gated_delta_rule, gated_rms_norm,
                      gdn_gate, recurrent_gated_delta_rule)
    from .registry import Backend, available_backends, register_backend, resolve_backend
    from .registry import import_backend_modules as _import_backend_modules
    from .validation import check_cu_seqlens, set_validation, validation_enabled
    from .warmup import warmup

    _import_backend_modules()      # each kernels/*_backend.py registers itself

    __all__ = [
        "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "causal_conv1d", "causal_conv1d_split",
        "causal_conv1d_gate", "gated_rms_norm", "gdn_gate",
        "Backend", "available_backends", "register_backend", "resolve_backend",
        "check_cu_seqlens", "set_validation", "validation_enabled", "warmup",
    ]
