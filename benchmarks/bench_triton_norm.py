"""GPU timing of the Triton gated RMSNorm (kernels/triton/norm.py) at Qwen3-Next's shape. Needs CUDA.

    python3 benchmarks/bench_triton_norm.py [--T 32768] [--heads 32] [--D 128] [--weight-dtype bfloat16]

Forward and backward times (median of ``triton.testing.do_bench``, bf16 x / z / dy, the weight in
``--weight-dtype``: bf16 as in a layer built in bf16, where the kernels round twice more) against
the bytes each must move at the measured copy bandwidth, and the backward for several caps on its
program count (``norm._MAX_PROGRAMS``: the programs loop over row tiles and each writes one row of the
partial dweight), so the cap can be chosen from a measurement. The tile sweep runs each tile with the
roundings done by the GPU's conversions (``norm.HW_RNE``, the default) and by bit arithmetic.
"""
import argparse
import os
import sys

import torch
import triton
from triton.testing import do_bench


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--weight-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from requires import require_cuda
    require_cuda("bench_triton_norm.py")
    from gdn_layer.kernels.triton import norm
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    shape = (1, args.T, args.heads, args.D)
    x, z, dy = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    w = torch.randn(args.D, device="cuda", dtype=getattr(torch, args.weight_dtype))
    big = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    bw = 2 * big.numel() / do_bench(lambda: big.clone(), return_mode="median") / 1e9  # TB/s, read + write
    n = x.numel() * 2
    print(f"copy bandwidth {bw:.2f} TB/s; floors: fwd {3 * n / bw / 1e9:.3f} ms (x, z in, y out), "
          f"bwd {5 * n / bw / 1e9:.3f} ms (dy, x, z in, dx, dz out)")
    y, rstd = norm.gated_rms_norm_fwd(x, z, w, 1e-6)
    print(f"fwd {do_bench(lambda: norm.gated_rms_norm_fwd(x, z, w, 1e-6), return_mode='median'):.3f} ms")
    default = norm._MAX_PROGRAMS
    for cap in (1024, 2048, 4096, 8192, 16384, 65535):
        norm._MAX_PROGRAMS = cap
        ms = do_bench(lambda: norm.gated_rms_norm_bwd(dy, x, z, w, rstd, 1e-6), return_mode="median")
        print(f"bwd, at most {cap:5d} programs: {ms:.3f} ms{'  (the default)' if cap == default else ''}")
    norm._MAX_PROGRAMS = default
    # tile (elements) and warps, each pass on its own (norm._TILE / _NUM_WARPS, _TILE_BWD / _NUM_WARPS_BWD)
    knobs = norm._TILE, norm._NUM_WARPS, norm._TILE_BWD, norm._NUM_WARPS_BWD, norm.HW_RNE
    print(f"tile sweep (defaults: fwd {norm._TILE} elements, bwd {norm._TILE_BWD}; warps by D unless set; "
          f"HW_RNE {norm.HW_RNE})")
    for (tile, nw), hw in ((c, hw) for hw in (True, False) for c in (
            (1024, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (16384, 8))):
        norm._TILE, norm._NUM_WARPS, norm._TILE_BWD, norm._NUM_WARPS_BWD, norm.HW_RNE = tile, nw, tile, nw, hw
        f = do_bench(lambda: norm.gated_rms_norm_fwd(x, z, w, 1e-6), return_mode="median")
        b = do_bench(lambda: norm.gated_rms_norm_bwd(dy, x, z, w, rstd, 1e-6), return_mode="median")
        # rstd=None: the backward recomputes rstd, as the layer's CUDA backends call it (kernels/triton_ops.py)
        r = do_bench(lambda: norm.gated_rms_norm_bwd(dy, x, z, w, None, 1e-6), return_mode="median")
        print(f"tile {tile:5d}, {nw} warps, HW_RNE {hw!s:5}: fwd {f:.3f} ms, bwd {b:.3f} ms (rstd saved), "
              f"{r:.3f} ms (recomputed)")
    norm._TILE, norm._NUM_WARPS, norm._TILE_BWD, norm._NUM_WARPS_BWD, norm.HW_RNE = knobs
    # z as a column slice of a wider projection output (transformers' fused in_proj_qkvz layout): its rows
    # are not one stride apart, so the kernels get a copy of it (norm._rows)
    zw = torch.randn(1, args.T, 2 * args.heads * args.D, device="cuda", dtype=torch.bfloat16)
    zs = zw[..., args.heads * args.D:].unflatten(-1, (args.heads, args.D))
    f = do_bench(lambda: norm.gated_rms_norm_fwd(x, zs, w, 1e-6), return_mode="median")
    b = do_bench(lambda: norm.gated_rms_norm_bwd(dy, x, zs, w, rstd, 1e-6), return_mode="median")
    print(f"z a column slice of a wider buffer (copied): fwd {f:.3f} ms, bwd {b:.3f} ms")


if __name__ == "__main__":
    main()
