"""Run by tests/test_fla_chunk_index.py with fla-core on the path: records whether fla's ``tensor_cache``
is switched off (``fla.utils.FLA_DISABLE_TENSOR_CACHE``) when the fla backend calls fla's chunk functions,
with the capture state forced to ``argv[1]`` (1 or 0). fla's functions are stubbed (no kernel runs).

Prints ``RESULT {"seen": [...], "after": bool, "fla_reads_the_switch": bool}`` (the last: fla's
``prepare_lens`` returns its cached result with the switch off and a new one with it on).
"""
import json
import sys

import torch

import fla.ops.gated_delta_rule.chunk as fla_chunk
import fla.ops.gated_delta_rule.chunk_fwd as fla_chunk_fwd
import fla.ops.utils as fla_ops_utils
import fla.utils as fla_utils
from gdn_layer.kernels import cu_cache, fla_backend

# the switch this relies on: fla reads it at each call (a cached result comes back only while it is off)
from fla.ops.utils.index import prepare_lens  # noqa: E402
cu0 = torch.tensor([0, 3, 9])
fla_utils.FLA_DISABLE_TENSOR_CACHE = False
kept = prepare_lens(cu0) is prepare_lens(cu0)
fla_utils.FLA_DISABLE_TENSOR_CACHE = True
fresh = prepare_lens(cu0) is not prepare_lens(cu0)

capturing = bool(int(sys.argv[1]))
cu_cache.capturing = lambda t: capturing
fla_utils.FLA_DISABLE_TENSOR_CACHE = False
seen = []


def returning(*outputs):
    def stub(*args, **kwargs):
        seen.append(fla_utils.FLA_DISABLE_TENSOR_CACHE)
        return outputs[0] if len(outputs) == 1 else outputs
    return stub


T, H, D = 70, 2, 8
q, k, v = (torch.randn(1, T, H, D) for _ in range(3))
g, beta = -torch.rand(1, T, H), torch.rand(1, T, H)
cu = torch.tensor([0, 30, 70])
fla_chunk.chunk_gated_delta_rule_fwd = returning(None, v, None, None, None, None)
fla_ops_utils.chunk_local_cumsum = returning(g)
fla_chunk_fwd.chunk_gated_delta_rule_fwd_intra = returning(None, None, None)
fla_chunk.chunk_gated_delta_rule_bwd = returning(q, k, v, g, beta, None, None, None)
fla_backend.chunk_fwd(q, k, v, g, beta, scale=0.3, cu=cu)
fla_backend.chunk_bwd(v, None, q, k, v, g, beta, scale=0.3, cu=cu)
print("RESULT " + json.dumps({"seen": seen, "after": fla_utils.FLA_DISABLE_TENSOR_CACHE,
                              "fla_reads_the_switch": kept and fresh}))
