"""The Triton causal conv1d (kernels/triton/conv.py) against the torch reference, under the interpreter on CPU.

Every comparison draws random inputs and upstream grads (for y and for the final state) and checks
outputs, final states and the grads of x, weight, bias and initial_state. The oracle is the torch
reference run in float64 on the CPU on the same values; fp32 results must be within 1e-5 of it.
Where CUDA is present the kernels run compiled on it instead of under the interpreter.
"""
import importlib.util
import pathlib

import pytest
import torch

from gdn_layer.kernels import reference
from gdn_layer.kernels.triton import _grid, _layout, conv
from launch_spy import LaunchSpy

SCAN_TOOL = pathlib.Path("/work/shared/tools/scan_triton.py")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_inputs(B, T, C, W, cu=None, init=True, bias=True, dtype=torch.float32, extra=5, seed=0):
    """x as a channel slice of a wider [B, T, C + extra] buffer (how the layer hands it over)."""
    g = torch.Generator().manual_seed(seed)
    N = B if cu is None else len(cu) - 1
    buf = torch.randn(B, T, C + extra, generator=g).to(dtype)
    return dict(buf=buf, off=2, C=C,
                weight=torch.randn(C, W, generator=g) / W ** 0.5,
                bias=torch.randn(C, generator=g) if bias else None,
                cu=None if cu is None else torch.tensor(cu, dtype=torch.int64),
                init=torch.randn(N, C, W - 1, generator=g) if init else None,
                gy=torch.randn(B, T, C, generator=g), gf=torch.randn(N, C, W - 1, generator=g))


def run(fn, inp, activation, to=None, final=True, device="cpu"):
    """Forward + backward of ``fn`` on ``device``; returns (y, final, grads of x, weight, bias, initial_state)."""
    cast = (lambda t: t.to(device)) if to is None else (lambda t: t.to(device, to))
    buf = cast(inp["buf"]).clone().requires_grad_()
    x = buf[..., inp["off"]:inp["off"] + inp["C"]]
    leaves = [cast(inp[k]).clone().requires_grad_() if inp[k] is not None else None
              for k in ("weight", "bias", "init")]
    cu = None if inp["cu"] is None else inp["cu"].to(device)
    y, fin = fn(x, leaves[0], leaves[1], activation, cu, leaves[2], final)
    loss = (y.double() * inp["gy"].to(device).double()).sum()
    if final:
        loss = loss + (fin.double() * inp["gf"].to(device).double()).sum()
    grads = torch.autograd.grad(loss, [buf] + [t for t in leaves if t is not None])
    gx = grads[0][..., inp["off"]:inp["off"] + inp["C"]]
    rest = iter(grads[1:])
    return [y, fin, gx] + [next(rest) if t is not None else None for t in leaves]


def assert_matches_reference(inp, activation, tol=1e-5, final=True):
    got = run(conv.causal_conv1d, inp, activation, final=final, device=DEV)
    want = run(reference.causal_conv1d, inp, activation, to=torch.float64, final=final)
    names = ["y", "final_state", "dx", "dweight", "dbias", "dinitial"]
    for name, a, b in zip(names, got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    y, fin, dx, dw, db, dinit = got
    assert y.dtype == inp["buf"].dtype and y.is_contiguous()
    assert dx.dtype == inp["buf"].dtype and dw.dtype == inp["weight"].dtype
    if final:
        assert fin.dtype == torch.float32
    return got


def l2norm_heads(conv_fn, D):
    """``conv_fn`` with l2norm_dim=D: the kernels' own argument, or (the oracle) ``reference.l2norm`` per head
    of D channels after the reference conv."""
    def fn(x, weight, bias, activation, cu, init, final):
        if conv_fn is conv.causal_conv1d:
            return conv_fn(x, weight, bias, activation, cu, init, final, l2norm_dim=D)
        y, fin = conv_fn(x, weight, bias, activation, cu, init, final)
        return reference.l2norm(y.unflatten(-1, (-1, D))).flatten(-2), fin
    return fn


@pytest.mark.parametrize("C,D", [(256, 128), (96, 32), (24, 8), (64, 64)])
@pytest.mark.parametrize("B,cu", [(1, [0, 0, 1, 3, 40, 41, 70]), (2, None)])
@pytest.mark.parametrize("act", ["silu", None])
def test_l2norm_heads_in_the_conv_kernels_match_the_float64_reference(monkeypatch, C, D, B, cu, act):
    """``l2norm_dim``, the layer's q / k (no bias, no initial state, power-of-two heads up to 128): the forward
    kernel normalises each head of its tile and writes the factor rstd; the backward goes through the norm
    from y and rstd (one ``l2norm_bwd_from_output`` launch, no conv recompute), then the plain dz pass. Values,
    rstd and gradients against the float64 oracle; several tiles per program (the forward knob at 2)."""
    from gdn_layer.kernels.triton import l2norm
    monkeypatch.setattr(conv, "FWD_PROGRAMS", 2)
    spies = {k: LaunchSpy(getattr(conv, k)) for k in ("_conv_fwd_kernel", "_conv_dz_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(conv, name, spy)
    norm_spy = LaunchSpy(l2norm._l2norm_bwd_from_output_kernel)
    monkeypatch.setattr(l2norm, "_l2norm_bwd_from_output_kernel", norm_spy)
    inp = make_inputs(B, 70, C, 4, cu=cu, init=False, bias=False, seed=C + D)
    got = run(l2norm_heads(conv.causal_conv1d, D), inp, act, final=False, device=DEV)
    want = run(l2norm_heads(reference.causal_conv1d, D), inp, act, to=torch.float64, final=False)
    for name, a, b in zip(["y", "final", "dx", "dweight"], got[:4], want[:4]):
        if b is not None:
            assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    assert [kw["L2_D"] for kw in spies["_conv_fwd_kernel"].kwargs] == [D]
    assert len(spies["_conv_dz_kernel"].kwargs) == 1 and len(norm_spy.kwargs) == 1
    # the factor the forward hands the backward
    x = inp["buf"][..., inp["off"]:inp["off"] + C]
    cu_t = None if cu is None else inp["cu"]
    y, _, rstd = conv.causal_conv1d_fwd(x.to(DEV), inp["weight"].to(DEV), None, None if cu_t is None else cu_t.to(DEV),
                                        None, act, False, l2norm_dim=D)
    s = reference.causal_conv1d(x.double(), inp["weight"].double(), None, act, cu_t)[0]
    want_rstd = torch.rsqrt(s.unflatten(-1, (-1, D)).square().sum(-1) + 1e-6)
    assert rstd.shape == (B, 70, C // D) and rstd.dtype == torch.float32
    assert rel_err(rstd, want_rstd) <= 1e-5


def test_l2norm_bwd_from_output_matches_autograd_of_the_norm():
    """``l2norm_bwd_from_output`` (y and rstd, no x) equals autograd through ``reference.l2norm`` in float64;
    the float64 path equals it too."""
    from gdn_layer.kernels.triton import l2norm
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 9, 3, 32, generator=g) * torch.rand(2, 9, 3, 1, generator=g)).double().requires_grad_()
    dy = torch.randn(2, 9, 3, 32, generator=g).double()
    want, = torch.autograd.grad(reference.l2norm(x), x, dy)
    rstd = torch.rsqrt(x.detach().square().sum(-1) + 1e-6)
    y = x.detach() * rstd[..., None]
    got = l2norm.l2norm_bwd_from_output(y.float().to(DEV), rstd.float().to(DEV), dy.float().to(DEV))
    assert rel_err(got, want) <= 1e-5
    assert rel_err(l2norm.l2norm_bwd_from_output(y, rstd, dy), want) <= 1e-12


@pytest.mark.parametrize("C,D,init,bias", [(36, 12, False, False), (512, 256, False, False), (32, 8, True, False),
                                           (32, 8, False, True)])
def test_l2norm_heads_the_kernels_do_not_fuse_are_normalised_around_the_conv(monkeypatch, C, D, init, bias):
    """Heads that are no power of two or wider than a 128-channel tile, and a conv with initial states or bias:
    the conv kernel runs unnormalised (``L2_D`` 0) and the launcher normalises in torch; the same results."""
    spy = LaunchSpy(conv._conv_fwd_kernel)
    monkeypatch.setattr(conv, "_conv_fwd_kernel", spy)
    inp = make_inputs(1, 40, C, 4, cu=[0, 2, 17, 40], init=init, bias=bias, seed=C)
    got = run(l2norm_heads(conv.causal_conv1d, D), inp, "silu", device=DEV)
    want = run(l2norm_heads(reference.causal_conv1d, D), inp, "silu", to=torch.float64)
    for name, a, b in zip(["y", "final", "dx", "dweight", "dbias", "dinitial"], got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    assert {kw["L2_D"] for kw in spy.kwargs} == {0}


def test_l2norm_dim_must_divide_the_channels():
    x, w = torch.randn(1, 8, 24), torch.randn(24, 4)
    with pytest.raises(ValueError, match="l2norm_dim must be a positive divisor of the channel count 24"):
        conv.causal_conv1d_fwd(x, w, None, None, None, "silu", False, l2norm_dim=16)
    with pytest.raises(ValueError, match="split_sizes"):
        conv.causal_conv1d_fwd(x, w, None, None, None, "silu", False, split_sizes=[8, 16], l2norm_dim=8)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65])
@pytest.mark.parametrize("init,bias,act", [(True, True, "silu"), (False, False, None)])
def test_batch_without_cu_matches_reference(T, W, init, bias, act):
    assert_matches_reference(make_inputs(2, T, 12, W, init=init, bias=bias), act)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("cu", [[0, 0, 1, 3, 3, 64, 65, 130], [0, 130], [0, 2, 2, 2, 70, 71, 130, 130]])
@pytest.mark.parametrize("init,act", [(True, "silu"), (False, "identity"), (True, None)])
def test_packed_with_empty_and_short_sequences_matches_reference(cu, W, init, act):
    """Segments of length 0, 1 and 2 (< W-1 for W = 4) and sequences straddling the 64-token tiles."""
    assert_matches_reference(make_inputs(1, 130, 10, W, cu=cu, init=init, seed=len(cu) + W), act)


@pytest.mark.parametrize("W", [1, 3, 4, 5, 6])
@pytest.mark.parametrize("dz_programs", [1, 2, 8192])
def test_dz_pass_sums_dweight_over_a_programs_tiles(monkeypatch, W, dz_programs):
    """The dz pass sums the dweight / dbias products of taps 0..3 over all tiles a program takes and those
    of taps past 4 per tile: with 1 or 2 programs per channel block each program takes several of the 5
    tiles (packed, straddling them); W = 5, 6 run the taps past 4."""
    monkeypatch.setattr(conv, "DZ_PROGRAMS", dz_programs)
    assert_matches_reference(make_inputs(1, 150, 20, W, cu=[0, 3, 40, 41, 150], seed=W + dz_programs), "silu")


@pytest.mark.parametrize("W", [2, 4, 7])
@pytest.mark.parametrize("dz_programs", [1, 3])
def test_dz_pass_over_batch_rows_without_bias_or_state(monkeypatch, W, dz_programs):
    """Dense B = 3 (a program's tiles span batch rows), no bias, no initial state (the plain variant's program
    count), C over 2 channel blocks."""
    monkeypatch.setattr(conv, "DZ_PROGRAMS_PLAIN", dz_programs)
    assert_matches_reference(make_inputs(3, 70, 70, W, init=False, bias=False, seed=W), "silu", final=False)


@pytest.mark.parametrize("dz_tile", [(16, 16, 2), (8, 32, 4), (64, 16, 4)])
@pytest.mark.parametrize("dz_programs", [2, 8192])
def test_dz_pass_tile_differs_from_the_dx_pass_tile(monkeypatch, dz_tile, dz_programs):
    """The dz pass has its own tile (DZ_BLOCK_T x _dz_block_c, DZ_NUM_WARPS): its grid and tile count are
    its own, the dx pass (here with dfinal: the 32-token tiles) reads its dz in its own; packed over several
    channel blocks."""
    bt, bc, nw = dz_tile
    monkeypatch.setattr(conv, "DZ_BLOCK_T", bt)
    monkeypatch.setattr(conv, "_dz_block_c", lambda C: bc)
    monkeypatch.setattr(conv, "DZ_NUM_WARPS", nw)
    monkeypatch.setattr(conv, "DZ_PROGRAMS", dz_programs)
    spies = {k: LaunchSpy(getattr(conv, k)) for k in ("_conv_dz_kernel", "_conv_dx_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(conv, name, spy)
    assert_matches_reference(make_inputs(1, 150, 40, 4, cu=[0, 3, 40, 41, 150], seed=bt + bc), "silu")
    dz, dx = spies["_conv_dz_kernel"].kwargs[0], spies["_conv_dx_kernel"].kwargs[0]
    assert (dz["BLOCK_T"], dz["BLOCK_C"], dz["num_warps"]) == (bt, bc, nw)         # the dz pass: its own tile
    assert (dx["BLOCK_T"], dx["BLOCK_C"], dx["num_warps"]) == (conv.BLOCK_T, conv._block_c(40), conv.NUM_WARPS)


@pytest.mark.parametrize("bias,init", [(False, False), (True, False), (False, True)])
def test_dz_pass_takes_the_plain_tile_without_bias_and_initial_states(monkeypatch, bias, init):
    """The layer's conv in training has neither bias nor initial states: that kernel variant (fewer registers)
    takes ``DZ_BLOCK_T_PLAIN`` token rows per tile, any other ``DZ_BLOCK_T``; both match float64."""
    monkeypatch.setattr(conv, "DZ_BLOCK_T", 8)
    monkeypatch.setattr(conv, "DZ_BLOCK_T_PLAIN", 4)
    monkeypatch.setattr(conv, "DZ_PROGRAMS", 2)        # (2 or 1 program per channel block: several tiles each)
    monkeypatch.setattr(conv, "DZ_PROGRAMS_PLAIN", 1)
    monkeypatch.setattr(conv, "_stages", lambda stages, x, W: stages)    # (as on CUDA, whatever the device)
    spy = LaunchSpy(conv._conv_dz_kernel)
    monkeypatch.setattr(conv, "_conv_dz_kernel", spy)
    assert_matches_reference(make_inputs(1, 70, 24, 4, cu=[0, 5, 33, 70], bias=bias, init=init, seed=3), "silu",
                             final=init)
    plain = not (bias or init)
    assert spy.kwargs[0]["BLOCK_T"] == (4 if plain else 8)
    # the plain variant pipelines its tile loop, over its own program count (one per channel block here)
    assert spy.kwargs[0]["STAGES"] == (conv.DZ_NUM_STAGES_PLAIN if plain else conv.DZ_NUM_STAGES)
    assert spy.grids[0][0] == (1 if plain else 2), spy.grids


def test_the_dz_pass_pipelines_where_measured_only(monkeypatch):
    """The plain dz pass's pipelining depth was measured on an H200 with bf16 and W = 4; other devices (Ascend's
    compiler reads ``num_stages`` its own way, the interpreter ignores it) get the plain loop, and so do 4- and
    8-byte inputs and W > 4 (three stages of an fp64 conv with W >= 6 exceed the H200's shared memory)."""
    def x(dtype):
        return torch.empty(1, dtype=dtype)

    assert conv._stages(3, x(torch.bfloat16), 4) == 1
    monkeypatch.setattr(_grid, "on_cuda", lambda x: True)   # (the one CUDA predicate, as the compile probe sets it)
    assert conv._stages(3, x(torch.bfloat16), 4) == 3 and conv._stages(3, x(torch.float16), 2) == 3
    assert conv._stages(3, x(torch.float32), 4) == 1 and conv._stages(3, x(torch.float64), 4) == 1
    assert conv._stages(3, x(torch.bfloat16), 5) == 1


@pytest.mark.parametrize("knob", ["FWD_PROGRAMS", "DX_PROGRAMS", "DZ_PROGRAMS", "DZ_PROGRAMS_PLAIN"])
def test_a_program_knob_below_one_still_launches_one_program(monkeypatch, knob):
    """A ``*_PROGRAMS`` knob of 0 (a tuning mistake) runs one program per channel block, not none (which would
    leave y or dx unwritten)."""
    monkeypatch.setattr(conv, knob, 0)
    assert_matches_reference(make_inputs(1, 40, 12, 4, cu=[0, 5, 40], bias=knob == "DZ_PROGRAMS",
                                         init=knob == "DZ_PROGRAMS", seed=1), "silu", final=knob == "DZ_PROGRAMS")


@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("bias_and_state", [False, True])
def test_forward_and_dx_pass_take_several_tiles_per_program(monkeypatch, programs, bias_and_state):
    """``FWD_PROGRAMS`` / ``DX_PROGRAMS`` cap the forward's and the dx pass's programs (the knobs that
    bench_triton_conv.py --stages sweeps with their pipelining): each program then loops over several token
    tiles, packed with sequences straddling them; results match float64 and the grids hold the cap."""
    monkeypatch.setattr(conv, "FWD_PROGRAMS", programs)
    monkeypatch.setattr(conv, "DX_PROGRAMS", programs)
    spies = {k: LaunchSpy(getattr(conv, k)) for k in ("_conv_fwd_kernel", "_conv_dx_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(conv, name, spy)
    assert_matches_reference(make_inputs(1, 150, 40, 4, cu=[0, 3, 40, 41, 150], bias=bias_and_state,
                                         init=bias_and_state, seed=programs), "silu", final=bias_and_state)
    for spy in spies.values():
        assert spy.grids[0][0] == programs and spy.kwargs[0]["STAGES"] == 1, spy.grids


@pytest.mark.parametrize("bias,init,final", [(False, False, False), (True, False, False), (False, True, False),
                                              (False, False, True)])
def test_forward_takes_the_plain_tile_without_bias_and_initial_states(monkeypatch, bias, init, final):
    """The layer's conv in training has neither bias nor initial states: its forward takes ``PLAIN_BLOCK_T`` x
    ``_plain_block_c`` tiles, any other variant ``BLOCK_T`` x ``_block_c``; the dx pass the plain tile unless
    it adds a final state's gradient; all match float64 over several token tiles and channel blocks."""
    monkeypatch.setattr(conv, "BLOCK_T", 8)
    monkeypatch.setattr(conv, "PLAIN_BLOCK_T", 4)
    monkeypatch.setattr(conv, "_block_c", lambda C: 16)
    monkeypatch.setattr(conv, "_plain_block_c", lambda C: 32)
    spies = {k: LaunchSpy(getattr(conv, k)) for k in ("_conv_fwd_kernel", "_conv_dx_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(conv, name, spy)
    assert_matches_reference(make_inputs(1, 70, 40, 4, cu=[0, 5, 33, 70], bias=bias, init=init, seed=5), "silu",
                             final=final)
    fwd, dx = spies["_conv_fwd_kernel"].kwargs[0], spies["_conv_dx_kernel"].kwargs[0]
    assert (fwd["BLOCK_T"], fwd["BLOCK_C"]) == ((8, 16) if bias or init else (4, 32))
    assert (dx["BLOCK_T"], dx["BLOCK_C"]) == ((8, 16) if final else (4, 32))


def test_channel_major_inputs_past_the_32_bit_column_offset_are_copied(monkeypatch):
    """Channel offsets (c * channel stride) are 32-bit in the kernels: an x, dy, initial state or dfinal whose
    last channel lies ``_layout.OFFSET_LIMIT`` (2**31) elements or more from its first reaches them as a copy.
    The limit is lowered here so that small channel-major tensors pass it; results still match float64."""
    monkeypatch.setattr(_layout, "OFFSET_LIMIT", 64)
    g = torch.Generator().manual_seed(11)
    T, C, W = 40, 12, 4
    x = torch.randn(1, C, T, generator=g).to(DEV).transpose(1, 2)          # channel stride T: 11 * 40 >= 64
    dy = torch.randn(1, C, T, generator=g).to(DEV).transpose(1, 2)
    w, bias = (torch.randn(C, W, generator=g) / 2).to(DEV), torch.randn(C, generator=g).to(DEV)
    cu = torch.tensor([0, 7, 40], device=DEV)
    # states laid out channel-outermost ([C, W - 1, N] permuted): channel stride 3 * 2, 11 * 6 >= 64
    init = torch.randn(C, W - 1, 2, generator=g).to(DEV).permute(2, 0, 1)
    dfinal = torch.randn(C, W - 1, 2, generator=g).to(DEV).permute(2, 0, 1)
    spies = {k: LaunchSpy(getattr(conv, k)) for k in ("_conv_fwd_kernel", "_conv_dz_kernel", "_conv_dx_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(conv, name, spy)
    y, fin = conv.causal_conv1d_fwd(x, w, bias, cu, init, "silu", True)
    dx, dw, db, dinit = conv.causal_conv1d_bwd(dy, dfinal, x, w, bias, cu, init, "silu")
    fwd_args = spies["_conv_fwd_kernel"].launches[0]
    assert fwd_args[0].stride(-1) == 1 and fwd_args[3].is_contiguous()     # x and the state, copied
    dz_args = spies["_conv_dz_kernel"].launches[0]
    assert dz_args[0].stride(-1) == 1 and dz_args[6].stride(-1) == 1       # x and dy, copied
    assert spies["_conv_dx_kernel"].launches[0][4].is_contiguous()         # dfinal, copied
    xr = x.cpu().double().requires_grad_()
    wr, br, ir = (t.cpu().double().requires_grad_() for t in (w, bias, init))
    yr, fr = reference.causal_conv1d(xr, wr, br, "silu", cu.cpu(), ir, True)
    torch.autograd.backward([yr, fr], [dy.cpu().double(), dfinal.cpu().double()])
    for name, a, b in (("y", y, yr), ("final", fin, fr), ("dx", dx, xr.grad), ("dw", dw, wr.grad),
                       ("db", db, br.grad), ("dinit", dinit, ir.grad)):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_wide_channels_span_several_channel_blocks():
    assert_matches_reference(make_inputs(1, 70, 72, 3, cu=[0, 5, 70], seed=3), "swish")


def test_without_final_state_output_grads_still_match():
    assert_matches_reference(make_inputs(1, 40, 8, 4, cu=[0, 1, 17, 40]), "silu", final=False)


def test_final_state_of_empty_and_short_sequences_holds_their_initial_state():
    inp = {k: v.to(DEV) for k, v in make_inputs(1, 3, 8, 4, cu=[0, 0, 1, 3]).items() if torch.is_tensor(v)}
    x = inp["buf"][..., 2:10]
    _, fin = conv.causal_conv1d(x, inp["weight"], cu=inp["cu"], initial_state=inp["init"], output_final_state=True)
    assert torch.equal(fin[0], inp["init"][0])                                      # empty: its state unchanged
    assert torch.equal(fin[1], torch.cat([inp["init"][1][:, 1:], x[0, 0:1].T], 1))  # one token: 2 of its state
    assert torch.equal(fin[2], torch.cat([inp["init"][2][:, 2:], x[0, 1:3].T], 1))


def test_no_token_sees_another_sequence():
    inp = {k: v.to(DEV) for k, v in make_inputs(1, 30, 6, 4, cu=[0, 10, 30]).items() if torch.is_tensor(v)}
    x = inp["buf"][..., 2:8]
    y, _ = conv.causal_conv1d(x, inp["weight"], inp["bias"], cu=inp["cu"], initial_state=inp["init"])
    x2 = x.clone()
    x2[0, 9] += 5.0  # the last token of sequence 0
    y2, _ = conv.causal_conv1d(x2, inp["weight"], inp["bias"], cu=inp["cu"], initial_state=inp["init"])
    assert torch.equal(y[0, 10:], y2[0, 10:]) and not torch.equal(y[0, 9], y2[0, 9])


def test_strided_view_is_read_in_place(monkeypatch):
    fwd, bwd = LaunchSpy(conv._conv_fwd_kernel), LaunchSpy(conv._conv_dz_kernel)
    monkeypatch.setattr(conv, "_conv_fwd_kernel", fwd)
    monkeypatch.setattr(conv, "_conv_dz_kernel", bwd)
    inp = make_inputs(2, 33, 8, 4, extra=9)
    got = assert_matches_reference(inp, "silu")
    assert len(fwd.launches) == 1 and len(bwd.launches) == 1
    for (x_arg, *_), in ((fwd.launches[0],), (bwd.launches[0],)):
        assert not x_arg.is_contiguous() and x_arg.stride() == (33 * 17, 17, 1)
        assert x_arg.shape == (2, 33, 8) and x_arg.untyped_storage().nbytes() == 2 * 33 * 17 * 4
    assert got[2].shape == (2, 33, 8)


def test_bf16_within_bf16_tolerance():
    inp = make_inputs(1, 100, 16, 4, cu=[0, 2, 37, 100], dtype=torch.bfloat16)
    inp["weight"], inp["bias"], inp["init"] = (inp[k].bfloat16() for k in ("weight", "bias", "init"))
    got = run(conv.causal_conv1d, inp, "silu", device=DEV)
    want = run(reference.causal_conv1d, inp, "silu", to=torch.float64)
    for name, a, b in zip(["y", "final_state", "dx", "dweight", "dbias", "dinitial"], got, want):
        assert rel_err(a, b) <= 1e-2, (name, rel_err(a, b))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert all(g.dtype == torch.bfloat16 for g in got[2:])


def test_float64_is_computed_in_float64():
    inp = make_inputs(1, 50, 8, 4, cu=[0, 1, 20, 50], dtype=torch.float64)
    inp["weight"], inp["bias"], inp["init"] = (inp[k].double() for k in ("weight", "bias", "init"))
    got = run(conv.causal_conv1d, inp, "silu", device=DEV)
    want = run(reference.causal_conv1d, inp, "silu")
    for name, a, b in zip(["y", "final_state", "dx", "dweight", "dbias", "dinitial"], got, want):
        assert a.dtype == torch.float64 and rel_err(a, b) <= 1e-12, (name, rel_err(a, b))


def test_weight_and_bias_grads_are_deterministic():
    inp = make_inputs(1, 150, 8, 4, cu=[0, 70, 150])
    first, second = run(conv.causal_conv1d, inp, "silu", device=DEV), run(conv.causal_conv1d, inp, "silu", device=DEV)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.skipif(not SCAN_TOOL.exists(), reason=f"{SCAN_TOOL} not present")
def test_no_length_is_specialised(capsys):
    spec = importlib.util.spec_from_file_location("scan_triton", SCAN_TOOL)
    scan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scan)
    assert scan.main(str(pathlib.Path(conv.__file__).parent)) == 0, capsys.readouterr().out
    assert ", violations: 0" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_state_gradient_stays_fp32_accurate_with_16_bit_activations(dtype):
    """The scratch dz of the backward is 16-bit for 16-bit x; the fp32 initial-state gradient must not
    read it (it recomputes its dz in fp32): within 1e-5 of float64 on the same rounded inputs."""
    g = torch.Generator().manual_seed(0)
    B, T, C, W = 2, 40, 32, 4
    x = torch.randn(B, T, C, generator=g).to(dtype)
    w = torch.randn(C, W, generator=g) / 2
    h0 = torch.randn(B, C, W - 1, generator=g)
    gy, gf = torch.randn(B, T, C, generator=g).to(dtype), torch.randn(B, C, W - 1, generator=g)
    res = []
    for fn, cast, dev in ((conv.causal_conv1d, lambda t: t.clone(), DEV), (reference.causal_conv1d, lambda t: t.double(), "cpu")):
        xx, ww, hh = (cast(t).to(dev).requires_grad_() for t in (x, w, h0))
        y, fin = fn(xx, ww, None, "silu", None, hh, True)
        torch.autograd.backward([y, fin], [cast(gy).to(dev), cast(gf).to(dev)])
        res.append(hh.grad)
    assert res[0].dtype == torch.float32 and rel_err(res[0], res[1]) <= 1e-5, rel_err(res[0], res[1])


# ------------------------------------------------------------------------------------------------
# causal_conv1d_split: the output in parts (the layer's q, k, v), one launch per pass


def _split_run(split, inp, sizes, backend, to=None, device="cpu"):
    """Forward + backward of ``causal_conv1d_split`` (``split``) with the gradients of the parts given
    with odd strides (transposed copies); returns (parts, final, dx, dweight, dbias, dinitial)."""
    cast = (lambda t: t.to(device)) if to is None else (lambda t: t.to(device, to))
    buf = cast(inp["buf"]).clone().requires_grad_()
    x = buf[..., inp["off"]:inp["off"] + inp["C"]]
    w, b, h0 = (cast(inp[k]).clone().requires_grad_() if inp[k] is not None else None
                for k in ("weight", "bias", "init"))
    cu = None if inp["cu"] is None else inp["cu"].to(device)
    ys, fin = split(x, w, sizes, b, activation="silu", cu_seqlens=cu, initial_state=h0, output_final_state=True,
                    backend=backend)
    gys = [g.to(device, ys[0].dtype).transpose(0, 1).contiguous().transpose(0, 1)
           for g in inp["gy"].split(sizes, -1)]
    leaves = [t for t in (buf, w, b, h0) if t is not None]
    grads = iter(torch.autograd.grad([*ys, fin], leaves, [*gys, inp["gf"].to(device, fin.dtype)]))
    gx = next(grads)[..., inp["off"]:inp["off"] + inp["C"]]
    return [ys, fin, gx] + [next(grads) if t is not None else None for t in (w, b, h0)]


@pytest.mark.parametrize("sizes", [[16, 16, 40], [10, 0, 62], [72], [30, 42], [0, 72, 0]])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("backend", ["triton_cpu", "torch"])
def test_split_parts_match_the_float64_reference(triton_cpu_backend, sizes, packed, backend):
    """Parts of 0-72 channels whose boundaries fall inside a 64-channel block, packed (an empty
    segment) and dense: each part contiguous and equal to its columns of the float64 reference; the
    gradients from the parts' gradients (odd strides) equal the reference's."""
    from gdn_layer.kernels import causal_conv1d_split
    cu = [0, 5, 5, 40, 70] if packed else None
    inp = make_inputs(1 if packed else 2, 70, 72, 4, cu=cu, seed=len(sizes))
    got = _split_run(causal_conv1d_split, inp, sizes, backend, device=DEV if backend == "triton_cpu" else "cpu")
    want = run(reference.causal_conv1d, inp, "silu", to=torch.float64)
    assert len(got[0]) == len(sizes)
    assert [tuple(y.shape) for y in got[0]] == [(inp["buf"].shape[0], 70, s) for s in sizes]
    assert all(y.is_contiguous() and y.dtype == torch.float32 for y in got[0])
    assert rel_err(torch.cat(got[0], -1), want[0]) <= 1e-5
    for name, a, b in zip(["final_state", "dx", "dweight", "dbias", "dinitial"], got[1:], want[1:]):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_split_is_one_launch_per_pass(triton_cpu_backend, monkeypatch):
    from gdn_layer.kernels import causal_conv1d_split
    spies = {k: LaunchSpy(getattr(conv, k)) for k in ("_conv_fwd_kernel", "_conv_state_fwd_kernel", "_conv_dz_kernel",
                                                       "_conv_dx_kernel", "_conv_state_bwd_kernel")}
    for k, spy in spies.items():
        monkeypatch.setattr(conv, k, spy)
    _split_run(causal_conv1d_split, make_inputs(1, 40, 24, 4, cu=[0, 3, 40]), [8, 8, 8], "triton_cpu", device=DEV)
    assert {k: len(s.launches) for k, s in spies.items()} == dict.fromkeys(spies, 1)


@pytest.mark.parametrize("sizes,error", [((8, 8, 8, 0), TypeError), ([8, 8.0, 8], TypeError), ([8, True, 15], TypeError),
                                         ([-1, 25], TypeError), ([], TypeError), (24, TypeError), ([8, 8], ValueError)])
def test_split_sizes_are_checked(sizes, error):
    from gdn_layer.kernels import causal_conv1d_split
    with pytest.raises(error, match="split_sizes"):
        causal_conv1d_split(torch.randn(1, 5, 24), torch.randn(24, 4), sizes, backend="torch")


@pytest.mark.parametrize("unused", [0, 1, 2])
@pytest.mark.parametrize("backend", ["triton_cpu", "torch"])
def test_split_part_left_out_of_the_loss_gets_zero_gradient(triton_cpu_backend, unused, backend):
    """A part that feeds nothing (autograd hands the op None for it) counts as a zero gradient."""
    from gdn_layer.kernels import causal_conv1d_split
    sizes = [8, 16, 24]
    inp = make_inputs(1, 50, 48, 4, cu=[0, 7, 50], seed=unused)
    dev = DEV if backend == "triton_cpu" else "cpu"
    buf = inp["buf"].to(dev).requires_grad_()
    x = buf[..., 2:50]
    w, h0 = (inp[k].to(dev).requires_grad_() for k in ("weight", "init"))
    ys, fin = causal_conv1d_split(x, w, sizes, activation="silu", cu_seqlens=inp["cu"].to(dev), initial_state=h0,
                                  output_final_state=True, backend=backend)
    gys = list(inp["gy"].split(sizes, -1))
    used = [i for i in range(3) if i != unused]
    got = torch.autograd.grad([ys[i] for i in used] + [fin], [buf, w, h0], [gys[i].to(dev) for i in used] + [inp["gf"].to(dev)])
    gys[unused] = torch.zeros_like(gys[unused])
    want = run(reference.causal_conv1d, {**inp, "bias": None, "gy": torch.cat(gys, -1)}, "silu", to=torch.float64)
    for name, a, b in (("dx", got[0][..., 2:50], want[2]), ("dweight", got[1], want[3]), ("dinitial", got[2], want[5])):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("backend", ["triton_cpu", "torch"])
def test_split_with_no_tokens_passes_the_state_through(triton_cpu_backend, packed, backend):
    """T = 0 with an initial state: the final state is the initial state and its gradient is dfinal."""
    from gdn_layer.kernels import causal_conv1d_split
    dev = DEV if backend == "triton_cpu" else "cpu"
    B, cu = (1, torch.tensor([0, 0, 0], device=dev)) if packed else (2, None)
    h0 = torch.randn(2, 24, 3, device=dev, requires_grad=True)
    ys, fin = causal_conv1d_split(torch.randn(B, 0, 24, device=dev), torch.randn(24, 4, device=dev), [8, 8, 8],
                                  cu_seqlens=cu, initial_state=h0, output_final_state=True, backend=backend)
    assert [tuple(y.shape) for y in ys] == [(B, 0, 8)] * 3 and torch.equal(fin, h0)
    gf = torch.randn_like(fin)
    assert torch.equal(torch.autograd.grad(fin, h0, gf)[0], gf)


def test_split_launches_the_split_variant(triton_cpu_backend, monkeypatch):
    """On a ``conv_splits`` backend the parts are written and read by the kernels (``PARTS == 3``), not a
    whole conv and copies."""
    from gdn_layer.kernels import causal_conv1d_split
    names = ("_conv_fwd_kernel", "_conv_dz_kernel", "_conv_state_bwd_kernel")
    spies = {k: LaunchSpy(getattr(conv, k)) for k in names}
    for k, spy in spies.items():
        monkeypatch.setattr(conv, k, spy)
    _split_run(causal_conv1d_split, make_inputs(1, 40, 24, 4, cu=[0, 3, 40]), [8, 8, 8], "triton_cpu", device=DEV)
    assert {k: [kw["PARTS"] for kw in s.kwargs] for k, s in spies.items()} == dict.fromkeys(names, [3])


def test_a_conv_splits_backend_that_returns_one_tensor_is_named(triton_cpu_backend):
    import dataclasses

    from gdn_layer.kernels import causal_conv1d_split, registry
    b = dataclasses.replace(registry.backend_by_name("torch"), name="claims_splits", conv_splits=True,
                            causal_conv1d=lambda x, weight, split_sizes=None, **kw: registry.backend_by_name(
                                "torch").causal_conv1d(x, weight, **kw))
    registry.register_backend(b)
    try:
        with pytest.raises(TypeError, match="conv_splits=True"):
            causal_conv1d_split(torch.randn(1, 5, 24), torch.randn(24, 4), [8, 8, 8], backend="claims_splits")
    finally:
        registry._BACKENDS.pop("claims_splits")
