"""``"ascend"`` backend: Huawei Ascend NPUs through torch_npu and triton-ascend: fla-core's chunk
forward/backward (whose inner calls fla dispatches to its ``triton_ascend`` kernels on an NPU), fla's
fused recurrent kernel for decode (launched in slices of sequences, below), and our Triton kernels for
conv, gate, L2 norm and gated norm.

Registered only where ``torch_npu`` imports. Not run on an NPU by this project (no NPU is reachable
from its machines). What is checked without one (tests/test_ascend_compile.py, on triton-ascend's
compiler with a stand-in NPU driver): every kernel this backend launches lowers to ``ttadapter``, none
recompiles for a new packed layout, and no launch exceeds 65 535 programs for T up to 2^20 tokens and
N up to 2^16 sequences. tests/test_npu.py runs the layer against the torch reference on an NPU.
See docs/kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from . import cu_cache, fla_backend
from .registry import register_backend

# triton-ascend refuses a launch of more programs (same cap as kernels/triton/_grid.py)
MAX_PROGRAMS = 65535


def torch_npu_importable() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return True


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "npu":
        return False, "the ascend backend runs on NPU devices only"
    return fla_backend.fla_importable()


def decode_programs_per_sequence(num_v_heads: int, head_v_dim: int) -> int:
    """Programs fla-core 0.6's ``fused_recurrent_gated_delta_rule_fwd`` launches per sequence: one per
    value head and block of ``min(8, next_power_of_2(Dv))`` value columns (its grid is
    ``(NV * N * HV,)``). 512 at Hv = 32, Dv = 128: 128 sequences already make 65 536 programs."""
    bv = min(8, 1 << max(head_v_dim - 1, 0).bit_length())
    return num_v_heads * -(-head_v_dim // bv)


def recurrent_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
                  use_qk_l2norm=False):
    """fla's fused recurrent forward (``fla_backend.recurrent_fwd``) in slices of at most
    ``MAX_PROGRAMS // decode_programs_per_sequence`` sequences, each slice one launch; outputs
    concatenated (same values as one launch: sequences are independent). Packed slices read the
    boundaries from the host copy of ``cu`` (``cu_cache``: one device-to-host read per ``cu`` tensor)."""
    n = q.shape[0] if cu is None else cu.shape[0] - 1
    step = max(1, MAX_PROGRAMS // decode_programs_per_sequence(v.shape[2], v.shape[3]))
    if n <= step:
        return fla_backend.recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu,
                                         use_qk_l2norm)
    host = None if cu is None else cu_cache.host_copy(cu)
    outs, finals = [], []
    for a in range(0, n, step):
        b = min(n, a + step)
        if cu is None:
            part = [t[a:b] for t in (q, k, v, g, beta)]
            cu_part = None
        else:
            t0, t1 = int(host[a]), int(host[b])
            part = [t[:, t0:t1] for t in (q, k, v, g, beta)]
            cu_part = cu[a:b + 1] - cu[a]
        h0 = None if initial_state is None else initial_state[a:b]
        o, final = fla_backend.recurrent_fwd(*part, scale, h0, output_final_state, cu_part, use_qk_l2norm)
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=0 if cu is None else 1)
    return o, (torch.cat(finals) if output_final_state else None)


def make_backend():
    # fla's exact chunk index (one host read of cu per tensor): fla's triton_ascend chunk kernels find each
    # task's sequence from the chunk offsets, and the capacity index's padding rows would send them past
    # cu_seqlens (fla_backend.exact_chunk_index)
    exact = fla_backend.exact_chunk_index
    # conv_splits=False: one conv per part. The split conv's first kernels (a select of pointers) crashed
    # triton-ascend 3.2.0's lowering; the masked per-part access since lowers (tests/ascend_probe.py
    # --split-conv) but is not timed on an NPU. conv_l2norm=False: the conv's fused q / k norm (a reshape of
    # the channel block into heads) was never lowered by triton-ascend; the chunk kernels normalise
    return dataclasses.replace(fla_backend.make_backend(), name="ascend", available=available, priority=10,
                               conv_splits=False, conv_l2norm=False,
                               recurrent_gated_delta_rule=recurrent_fwd,
                               chunk_gated_delta_rule=functools.partial(fla_backend.chunk_fwd, index=exact),
                               chunk_gated_delta_rule_bwd=functools.partial(fla_backend.chunk_bwd, index=exact))


if torch_npu_importable():
    register_backend(make_backend())
