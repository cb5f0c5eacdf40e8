"""GPU check and timing of the Triton causal conv1d (kernels/triton/conv.py). Needs CUDA.

    python3 benchmarks/bench_triton_conv.py [--quick | --sweep | --stages | --stages-fwd-dx]

1. compiled variants stay fixed across packed layouts (T, N, lengths) once each flag combination ran;
2. forward + backward make no host sync (torch.cuda.set_sync_debug_mode("error"));
3. offsets past 2**31 elements (a [1, T, C + extra] receive buffer of > 2**31 elements) are right;
4. forward / backward times (median of triton.testing.do_bench) on a Qwen3-Next-like conv
   (C = 8192, W = 4, bf16, 32k packed tokens, x a channel slice of a wider buffer), per block config,
   against the bytes each must move at the measured copy bandwidth.

--quick times the shipped block config only; --sweep skips 1-3 and the comparisons and times the block
configs and the dz pass's tiles only; --stages times only the software pipelining (``*_NUM_STAGES``) and
program counts (``*_PROGRAMS``) of the dz pass, the forward and the dx pass; --stages-fwd-dx those of the
forward and the dx pass only.
"""
import os
import sys

import torch
import triton
from triton.testing import do_bench

from gdn_layer.kernels import reference
from gdn_layer.kernels.triton import conv


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compiled_count():
    total = 0
    for fn in (conv._conv_fwd_kernel, conv._conv_state_fwd_kernel, conv._conv_dz_kernel, conv._conv_dx_kernel,
               conv._conv_state_bwd_kernel):
        total += sum(len(v[0]) for v in fn.device_caches.values())
    return total


def random_cu(T, n, g):
    cuts = torch.sort(torch.randint(0, T + 1, (n - 1,), generator=g)).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]).cuda()


def fwd_bwd(x, w, b, cu, init, act="silu"):
    y, fin = conv.causal_conv1d(x, w, b, act, cu, init, True)
    (y.float().sum() + fin.sum()).backward()


def check_recompiles_and_syncs():
    g = torch.Generator().manual_seed(0)
    C, W = 256, 4
    w = torch.randn(C, W, device="cuda", requires_grad=True)
    b = torch.randn(C, device="cuda", requires_grad=True)
    layouts = [(T, n) for T in (1, 7, 64, 300, 4097) for n in (1, 3, 17)]
    for step, (T, n) in enumerate(layouts):
        buf = torch.randn(1, T, C + 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        init = torch.randn(n, C, W - 1, device="cuda", requires_grad=True)
        cu = random_cu(T, n, g)
        torch.cuda.set_sync_debug_mode("error")
        fwd_bwd(buf[..., :C], w, b, cu, init)
        fwd_bwd(buf[..., :C], w, b, None, None)  # B = 1 without cu
        torch.cuda.set_sync_debug_mode("default")
        if step == 0:
            first = compiled_count()
    print(f"compiled variants after the first layout: {first}, after {len(layouts)} layouts: {compiled_count()}")
    assert compiled_count() == first, "a new layout compiled a new variant"
    print("no host sync in forward + backward (sync debug mode 'error')")


def check_against_reference():
    g = torch.Generator().manual_seed(1)
    for T, n, W, dt, tol in ((4097, 9, 4, torch.float32, 1e-5), (300, 5, 2, torch.float32, 1e-5),
                             (4097, 9, 4, torch.bfloat16, 1e-2)):
        C = 200
        buf = torch.randn(1, T, C + 24, generator=g).to(dt)
        w, b = torch.randn(C, W, generator=g).to(dt), torch.randn(C, generator=g).to(dt)
        init = torch.randn(n, C, W - 1, generator=g).to(dt)
        cu = random_cu(T, n, g).cpu()
        gy, gf = torch.randn(1, T, C, generator=g), torch.randn(n, C, W - 1, generator=g)
        outs = []
        for fn, dev, cast in ((conv.causal_conv1d, "cuda", None), (reference.causal_conv1d, "cpu", torch.float64)):
            leaves = [t.to(dev, cast or t.dtype).requires_grad_() for t in (buf, w, b, init)]
            y, fin = fn(leaves[0][..., 8:8 + C], leaves[1], leaves[2], "silu", cu.to(dev), leaves[3], True)
            ((y.double() * gy.to(dev).double()).sum() + (fin.double() * gf.to(dev).double()).sum()).backward()
            outs.append([y, fin] + [t.grad for t in leaves])
        errs = [rel_err(a, r) for a, r in zip(*outs)]
        print(f"T={T} N={n} W={W} {dt}: rel err y, final, dx, dw, db, dinit = " + " ".join(f"{e:.1e}" for e in errs))
        assert max(errs) <= tol


def check_int64_offsets():
    C, extra, W = 4096, 64, 4
    T = 2 ** 31 // (C + extra) + 3000  # the receive buffer holds more than 2**31 elements
    buf = torch.randn(1, T, C + extra, device="cuda", dtype=torch.bfloat16)
    x = buf[..., :C]
    w = torch.randn(C, W, device="cuda")
    cu = torch.tensor([0, T - 2500, T - 20, T], device="cuda")
    init = torch.randn(3, C, W - 1, device="cuda")
    y, fin = conv.causal_conv1d(x, w, None, "silu", cu, init, True)
    dy = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16)
    dx, dw, _, dinit = conv.causal_conv1d_bwd(dy, None, x, w, None, cu, init, "silu")
    tail = slice(T - 2500, T)
    xs = x[:, tail].double().cpu().requires_grad_()
    ws, cs, inits = w.double().cpu().requires_grad_(), (cu[1:] - cu[1]).cpu(), init[1:].double().cpu().requires_grad_()
    y_ref, fin_ref = reference.causal_conv1d(xs, ws, None, "silu", cs, inits, True)
    (y_ref * dy[:, tail].double().cpu()).sum().backward()
    errs = [rel_err(y[:, tail], y_ref), rel_err(fin[1:], fin_ref), rel_err(dx[:, tail], xs.grad),
            rel_err(dinit[1:], inits.grad)]
    print(f"past 2**31 elements (T={T}, buffer {buf.numel() / 2 ** 31:.2f} * 2**31): rel err y, final, dx, dinit = "
          + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= 1e-2
    del y, dx
    # the layer's variant in training (neither initial nor final state: the plain tiles)
    y, _ = conv.causal_conv1d(x, w, None, "silu", cu, None, False)
    dx, _, _, _ = conv.causal_conv1d_bwd(dy, None, x, w, None, cu, None, "silu")
    xs = x[:, tail].double().cpu().requires_grad_()
    y_ref, _ = reference.causal_conv1d(xs, w.double().cpu(), None, "silu", cs, None, False)
    (y_ref * dy[:, tail].double().cpu()).sum().backward()
    errs = [rel_err(y[:, tail], y_ref), rel_err(dx[:, tail], xs.grad)]
    print("past 2**31 elements, without initial or final state: rel err y, dx = " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) <= 1e-2
    del buf, x, y, dx, dy


def bench(quick, sweep=False, stages=False, dz=True):
    C, W, T, extra = 8192, 4, 32768, 2048
    buf = torch.randn(1, T, C + extra, device="cuda", dtype=torch.bfloat16)
    x = buf[..., :C]
    w, b = torch.randn(C, W, device="cuda"), torch.randn(C, device="cuda")
    cu = torch.tensor([0, 3000, 3001, 11000, 20000, 20000, 32768], device="cuda")
    init = torch.randn(6, C, W - 1, device="cuda")
    dy = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16)
    big = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    copy_ms = do_bench(lambda: big.clone(), return_mode="median")
    bw = 2 * big.numel() / copy_ms / 1e9  # TB/s, read + write
    fwd_bytes, bwd_bytes = 2 * T * C * 2, 3 * T * C * 2
    print(f"copy bandwidth {bw:.2f} TB/s; floors: fwd {fwd_bytes / bw / 1e9:.3f} ms, bwd {bwd_bytes / bw / 1e9:.3f} ms")
    if stages:
        bench_stages(x, w, b, cu, init, dy, dz)
        return
    ref_ms = do_bench(lambda: reference.causal_conv1d(x, w, b, "silu", cu, init, True), return_mode="median")
    print(f"torch reference forward: {ref_ms:.3f} ms")
    # None: the shipped tiles (the forward's with bias or states, its plain one, the dx pass's); a config sets
    # all three to one tile while the dz pass keeps its own
    configs = [None] if quick else [
        (32, 64, 4), (16, 64, 4), (64, 32, 4), (64, 64, 4), (64, 128, 4), (64, 64, 8), (128, 32, 4), (128, 64, 8),
        (32, 128, 4), (16, 128, 4), (32, 128, 8), (32, 256, 8), (16, 256, 4), (64, 256, 8)]
    rows = []
    shipped = conv.BLOCK_T, conv.PLAIN_BLOCK_T, conv._block_c, conv._plain_block_c, conv.NUM_WARPS, conv._dz_block_c
    conv._dz_block_c = (lambda C, c=conv._dz_block_c(C): c)     # (the dz pass keeps its tile while these change)
    for config in configs:
        if config is None:
            bt, bc = f"{conv.BLOCK_T}/{conv.PLAIN_BLOCK_T}", f"{conv._block_c(C)}/{conv._plain_block_c(C)}"
            nw = conv.NUM_WARPS
        else:
            bt, bc, nw = config
            conv.BLOCK_T = conv.PLAIN_BLOCK_T = bt
            conv._block_c = conv._plain_block_c = (lambda C, bc=bc: bc)
            conv.NUM_WARPS = nw
        try:
            f = do_bench(lambda: conv.causal_conv1d_fwd(x, w, b, cu, init, "silu", True), return_mode="median")
            bw_ms = do_bench(lambda: conv.causal_conv1d_bwd(dy, None, x, w, b, cu, init, "silu"), return_mode="median")
            # the layer's variant in training: neither bias nor initial states, no final state
            fp = do_bench(lambda: conv.causal_conv1d_fwd(x, w, None, cu, None, "silu", False), return_mode="median")
            bp = do_bench(lambda: conv.causal_conv1d_bwd(dy, None, x, w, None, cu, None, "silu"), return_mode="median")
        except Exception as e:  # a config the compiler refuses (e.g. out of shared memory): report, go on
            print(f"block {bt} x {bc}, {nw} warps: failed ({type(e).__name__})")
            continue
        rows.append((bt, bc, nw, f, bw_ms, fp, bp))
    print("BLOCK_T BLOCK_C warps   fwd ms  (GB/s)   bwd ms  (GB/s) | without bias and states: fwd ms  bwd ms")
    for bt, bc, nw, f, bw_ms, fp, bp in sorted(rows, key=lambda r: r[5] + r[6]):
        print(f"{bt:>7} {bc:>7} {nw:5d} {f:8.3f} {fwd_bytes / f / 1e6:7.0f} {bw_ms:8.3f} {bwd_bytes / bw_ms / 1e6:7.0f}"
              f" | {fp:8.3f} {bp:8.3f}")
    conv.BLOCK_T, conv.PLAIN_BLOCK_T, conv._block_c, conv._plain_block_c, conv.NUM_WARPS, conv._dz_block_c = shipped
    if hasattr(conv, "DZ_PROGRAMS") and not sweep:  # the dz pass's program count (dweight reduced once per program)
        default = conv.DZ_PROGRAMS
        for n in (1024, 2048, 4096, 8192, 16384, 65535):
            conv.DZ_PROGRAMS = n
            ms = do_bench(lambda: conv.causal_conv1d_bwd(dy, None, x, w, b, cu, init, "silu"), return_mode="median")
            print(f"DZ_PROGRAMS {n:6d}: bwd {ms:.3f} ms")
        conv.DZ_PROGRAMS = default
    if hasattr(conv, "DZ_BLOCK_T"):  # the dz pass's own tile and warps (five accumulators per tile)
        bench_dz_tiles(x, w, b, cu, init, dy)
    if not sweep:
        bench_split(x, w, b, cu, init, dy)
        compare_fla(x, w, b, cu, init, dy)


def bench_dz_tiles(x, w, b, cu, init, dy):
    """Backward time for dz-pass tiles (DZ_BLOCK_T x channel block, warps; the dx pass keeps its tile), with
    bias and initial states, and as the layer trains (neither: another variant, fewer registers)."""
    default = conv.DZ_BLOCK_T, conv.DZ_BLOCK_T_PLAIN, conv._dz_block_c, conv.DZ_NUM_WARPS
    C = x.shape[-1]
    print(f"dz pass tile (default {conv.DZ_BLOCK_T} x {conv._dz_block_c(C)} with bias or initial states, "
          f"{conv.DZ_BLOCK_T_PLAIN} x {conv._dz_block_c(C)} without, {conv.DZ_NUM_WARPS} warps): bwd ms "
          f"with bias and initial states / without either (the layer's conv in training)")
    for bt, bc, nw in ((32, 64, 4), (16, 64, 4), (16, 64, 2), (8, 64, 2), (16, 32, 2), (32, 32, 4),
                       (16, 128, 4), (8, 128, 4), (32, 128, 8), (32, 64, 8), (64, 64, 8)):
        conv.DZ_BLOCK_T, conv.DZ_BLOCK_T_PLAIN, conv._dz_block_c, conv.DZ_NUM_WARPS = bt, bt, (lambda C, bc=bc: bc), nw
        times = []
        for bias, state in ((b, init), (None, None)):
            def run(bias=bias, state=state):
                return conv.causal_conv1d_bwd(dy, None, x, w, bias, cu, state, "silu")
            try:
                times.append(f"{do_bench(run, return_mode='median'):.3f}")
            except Exception as e:  # a config the compiler refuses (e.g. out of shared memory)
                times.append(f"failed ({type(e).__name__})")
        print(f"dz tile {bt:3d} x {bc:3d}, {nw} warps: bwd {times[0]} / {times[1]} ms")
    conv.DZ_BLOCK_T, conv.DZ_BLOCK_T_PLAIN, conv._dz_block_c, conv.DZ_NUM_WARPS = default


def _sweep_knobs(label, names, rows, runs, check):
    """Sets the conv's knobs ``names`` to each row's values (None: as shipped, first and last), checks the outputs
    (``check()``: relative errors against the shipped setting) and times ``runs``; restores the knobs."""
    shipped = tuple(getattr(conv, k) for k in names)
    print(f"{label} (shipped: " + ", ".join(f"{k} {v}" for k, v in zip(names, shipped)) + ")")
    for row in [None, *rows, None]:
        for k, v in zip(names, shipped if row is None else row):
            setattr(conv, k, v)
        st, n = ("shipped", "") if row is None else row[:2]
        try:
            err = max(check())
            t = [do_bench(fn, return_mode="median") for fn in runs]
            print(f"  stages {st} programs {n:>5}: {t[0]:.3f} / {t[1]:.3f} ms  (max rel err {err:.1e})")
        except Exception as e:  # a config the compiler refuses (shared memory)
            print(f"  stages {st} programs {n:>5}: failed ({type(e).__name__})")
    for k, v in zip(names, shipped):
        setattr(conv, k, v)


def bench_stages(x, w, b, cu, init, dy, dz=True):
    """The software pipelining depth (``*_NUM_STAGES``: 1 is the plain loop) and program count (``*_PROGRAMS``:
    fewer programs, more tiles each, more to pipeline) of the dz pass (a row sets the plain variant's knobs and the
    other's alike), then of the forward and of the dx pass (the dz pass as shipped). Each row times the layer's
    three convs of Qwen3-Next (q, k, v: 2048, 2048 and 4096 channels of one pre-conv buffer, no bias or states,
    one dx buffer) and the whole conv with bias and initial states (the dx pass's row with a final state's
    gradient too), and checks their outputs against the shipped setting."""
    C = x.shape[-1]
    sizes = [C // 4, C // 4, C // 2]
    starts = (0, sizes[0], sizes[0] + sizes[1])
    dys = [p.contiguous() for p in dy.split(sizes, -1)]
    ws = w.split(sizes, 0)
    dx = torch.empty_like(dy)
    dfinal = torch.randn(init.shape, device=init.device)

    def qkv():
        for d, s, wp in zip(dys, starts, ws):
            conv.causal_conv1d_bwd(d, None, x[..., s:s + d.shape[-1]], wp, None, cu, None, "silu",
                                   dx=dx[..., s:s + d.shape[-1]])
        return [dx]

    def whole():
        return conv.causal_conv1d_bwd(dy, None, x, w, b, cu, init, "silu")

    def whole_df():
        return conv.causal_conv1d_bwd(dy, dfinal, x, w, b, cu, init, "silu")

    def qkv_fwd():
        return [conv.causal_conv1d_fwd(x[..., s:s + d.shape[-1]], wp, None, cu, None, "silu", False)[0]
                for d, s, wp in zip(dys, starts, ws)]

    def whole_fwd():
        return conv.causal_conv1d_fwd(x, w, b, cu, init, "silu", True)

    def qkv_zeroed():  # (checked from a zeroed buffer: a column left unwritten shows)
        dx.zero_()
        return qkv()

    def against(*fns):
        """check() of _sweep_knobs: the outputs of fns against theirs now (the shipped setting)."""
        want = [t.clone() for fn in fns for t in fn() if t is not None]
        return lambda: [rel_err(a, r) for a, r in zip([t for fn in fns for t in fn() if t is not None], want)]

    if dz:
        _sweep_knobs("dz pass: backward ms, the layer's q, k, v convs / the whole conv with bias and initial states",
                     ("DZ_NUM_STAGES", "DZ_PROGRAMS", "DZ_NUM_STAGES_PLAIN", "DZ_PROGRAMS_PLAIN"),
                     [(st, n) * 2 for st in (1, 2, 3, 4) for n in (8192, 4096, 2048, 1024, 512, 256)],
                     (qkv, whole), against(qkv_zeroed, whole))
    rows = [(st, n) for st in (1, 2, 3) for n in (65535, 4096, 2048, 1024, 512)]
    _sweep_knobs("forward: ms, the layer's q, k, v convs / the whole conv with bias and initial states",
                 ("FWD_NUM_STAGES", "FWD_PROGRAMS"), rows, (qkv_fwd, whole_fwd), against(qkv_fwd, whole_fwd))
    _sweep_knobs("dx pass: backward ms, the layer's q, k, v convs / the whole conv with bias, initial states and "
                 "a final state's gradient", ("DX_NUM_STAGES", "DX_PROGRAMS"), rows, (qkv, whole_df),
                 against(qkv_zeroed, whole_df))


def bench_split(x, w, b, cu, init, dy):
    """The split conv (``split_sizes``: q, k, v of Qwen3-Next written as three parts, PARTS == 3) against
    the whole conv with the same total channels: the ``conv_splits`` flag of the CUDA backends
    (kernels/fla_backend.py) goes on only where the split is not slower."""
    C = x.shape[-1]
    sizes = [C // 4, C // 4, C // 2]
    dys = [p.contiguous() for p in dy.split(sizes, -1)]
    whole = (do_bench(lambda: conv.causal_conv1d_fwd(x, w, b, cu, init, "silu", True), return_mode="median"),
             do_bench(lambda: conv.causal_conv1d_bwd(dy, None, x, w, b, cu, init, "silu"), return_mode="median"))
    split = (do_bench(lambda: conv.causal_conv1d_fwd(x, w, b, cu, init, "silu", True, split_sizes=sizes),
                      return_mode="median"),
             do_bench(lambda: conv.causal_conv1d_bwd(dys, None, x, w, b, cu, init, "silu"), return_mode="median"))
    print(f"whole conv: fwd {whole[0]:.3f} ms, bwd {whole[1]:.3f} ms; split {sizes}: fwd {split[0]:.3f} ms, "
          f"bwd {split[1]:.3f} ms (split / whole: {split[0] / whole[0]:.2f}x, {split[1] / whole[1]:.2f}x)")


def compare_fla(x, w, b, cu, init, dy):
    """Ours vs fla's Triton causal_conv1d on the same inputs, forward and forward+backward through autograd
    (fla gets a contiguous x: it does not take a channel slice)."""
    try:
        from fla.modules.causal_conv1d.ops import causal_conv1d as fla_conv
    except ImportError as e:
        print(f"fla's causal_conv1d not importable: {e}")
        return
    xc = x.contiguous().requires_grad_()
    xs = x.detach().requires_grad_()  # ours reads the slice in place
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    runs = {"ours": lambda: conv.causal_conv1d(xs, wl, bl, "silu", cu, init, True)[0],
            "fla": lambda: fla_conv(xc, wl, bl, None, init, True, "silu", cu_seqlens=cu.to(torch.int32))[0]}
    for name, fn in runs.items():
        try:
            with torch.no_grad():
                f = do_bench(fn, return_mode="median")
            fb = do_bench(lambda: fn().backward(dy), return_mode="median")
            print(f"{name:5s} conv (autograd): fwd {f:.3f} ms, fwd+bwd {fb:.3f} ms")
        except Exception as e:  # report, keep going
            print(f"{name} conv failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from requires import help_if_asked, require_cuda
    help_if_asked(__doc__)
    require_cuda("bench_triton_conv.py")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    stages = "--stages" in sys.argv or "--stages-fwd-dx" in sys.argv
    if "--sweep" not in sys.argv and not stages:
        check_against_reference()
        check_recompiles_and_syncs()
        check_int64_offsets()
    bench("--quick" in sys.argv, sweep="--sweep" in sys.argv, stages=stages, dz="--stages-fwd-dx" not in sys.argv)
