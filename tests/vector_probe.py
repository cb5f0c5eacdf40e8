"""Compile the layer's Triton kernels for an SM90 GPU on this CPU machine and report how their tile loops
touch 16-bit data: prints one JSON line ``RESULT {"call:kernel": {"scalar16_in_loop": n, "vector_in_loop": m}}``.

Run as a script (tests/test_triton_vector_access.py does, in a subprocess): it drops TRITON_INTERPRET,
installs ``fake_cuda_driver`` (real compile pipeline, no-op launches) through ``compile_probe`` and calls
the kernels with the layer's training flags (bf16, packed, no bias, no conv states, Qwen3-Next's head
dims): the conv (whole and split outputs), the q/k L2 norm pair and the gated RMSNorm, forward and
backward. In each kernel's PTX, everything after the entry block (the first ``$L__BB`` label: the tile
loops) is scanned for 2-byte global loads and stores (``ld/st.global[...].b16``, one element per
instruction) and for vector ones (``.v2``/``.v4``).
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_probe  # noqa: E402  (a fresh TRITON_CACHE_DIR and the fake SM90 driver)

import torch  # noqa: E402

ACCESS = re.compile(r"\b(?:ld|st)\.global\S*")   # every global load / store, with all its qualifiers


def layer_kernels(T=3000, Hk=2, Hv=4, D=128, W=4, dtype=torch.bfloat16):
    """``{label: call}``: the layer's kernel calls in training, one label per compiled variant."""
    from gdn_layer.kernels import triton_ops
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 700, 2900, T])
    C = 2 * Hk * D + Hv * D
    mixed = torch.randn(1, T, C + 2 * Hv, dtype=dtype, generator=g)   # [q | k | v | a | b], read in place
    x = mixed[..., :C]
    weight = torch.randn(C, W, dtype=dtype, generator=g)
    dy = torch.randn(1, T, C, dtype=dtype, generator=g)
    sizes = [Hk * D, Hk * D, Hv * D]
    x2 = torch.randn(2, T // 2, C + 2 * Hv, dtype=dtype, generator=g)[..., :C]
    dy2 = torch.randn(2, T // 2, C, dtype=dtype, generator=g)
    q, k = (torch.randn(1, T, Hk, D, dtype=dtype, generator=g) for _ in range(2))
    o, z = (torch.randn(1, T, Hv, D, dtype=dtype, generator=g) for _ in range(2))
    norm_weight = torch.randn(D, dtype=dtype, generator=g)
    # dx written into the columns of the pre-conv buffer's gradient, as the layer's conv_gate op does
    dx = torch.empty(1, T, C + 2 * Hv, dtype=dtype)[..., :C]
    dx2 = torch.empty(2, T // 2, C + 2 * Hv, dtype=dtype)[..., :C]
    return {
        "conv": lambda: (triton_ops.conv_fwd(x, weight, None, "silu", cu),
                         triton_ops.conv_bwd(dy, None, x, weight, None, "silu", cu, dx=dx)),
        # two rows, no cu_seqlens (a padded batch)
        "conv_dense": lambda: (triton_ops.conv_fwd(x2, weight, None, "silu"),
                               triton_ops.conv_bwd(dy2, None, x2, weight, None, "silu", dx=dx2)),
        # the split conv (backends with conv_splits; off in the shipped backends)
        "conv_split": lambda: (triton_ops.conv_fwd(x, weight, None, "silu", cu, split_sizes=sizes),
                               triton_ops.conv_bwd(list(dy.split(sizes, -1)), None, x, weight, None, "silu", cu)),
        "l2norm": lambda: triton_ops.l2norm_qk_bwd(q, k, *triton_ops.l2norm_qk_fwd(q, k)),
        "norm": lambda: (triton_ops.norm_fwd(o, z, norm_weight), triton_ops.norm_bwd(o, o, z, norm_weight)),
    }


def loop_accesses(ptx: str) -> dict:
    """Global accesses after the entry block: 2-byte ones, other one-element ones of at most 4 bytes (a 16-bit
    row read two elements at a time shows as these; so do the packed path's per-token sequence index loads),
    and vector ones (``.v2`` / ``.v4``)."""
    body = ptx[ptx.index("$L__BB"):] if "$L__BB" in ptx else ""
    found = ACCESS.findall(body)
    vector = [a for a in found if re.search(r"\.v[24]\.", a)]
    scalar = [a for a in found if a not in vector]
    return {"scalar16_in_loop": sum(bool(re.search(r"\.[bus]16$", a)) for a in scalar),
            "scalar32_in_loop": sum(bool(re.search(r"\.[busf]32$", a)) for a in scalar),
            "vector_in_loop": len(vector)}


def negative_control():
    """A row copy whose row stride is a runtime (``do_not_specialize``) argument: the compiler cannot prove
    16-byte rows, so its loop must show 2-byte accesses (what the test's control relies on)."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["stride"])
    def copy_rows(x, y, M, stride, D: tl.constexpr):
        for m in range(tl.program_id(0), M, tl.num_programs(0)):
            cols = tl.arange(0, D)
            tl.store(y + m * D + cols, tl.load(x + m * stride + cols))

    x = torch.randn(10, 136, dtype=torch.bfloat16)
    return {"control": lambda: copy_rows[(4,)](x, torch.empty(10, 128, dtype=torch.bfloat16), 10, 136, D=128)}


def main():
    compile_probe.pretend_h200()
    cache, seen, result = os.environ["TRITON_CACHE_DIR"], set(), {}
    calls = negative_control() if "--negative-control" in sys.argv else layer_kernels()
    for label, call in calls.items():
        call()
        for path in sorted(set(glob.glob(os.path.join(cache, "**", "*.ptx"), recursive=True)) - seen):
            seen.add(path)
            result[f"{label}:{os.path.basename(path)[:-4]}"] = loop_accesses(open(path).read())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
