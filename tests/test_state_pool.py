"""The serving state pool (``layer.new_state``, ``state_slots``, ``checkpoint_slots``): rows read and written
in place equal running each sequence alone through the ``GDNState`` path (fp64, to rounding), other rows are
never touched, padding sequences give zeros and write nothing, checkpoints hold the states after every E-th
token, bad input is refused before anything is written, and no value is read on the host."""
import pytest
import torch

from gdn_layer import GatedDeltaNet, GDNState
from gdn_layer.kernels.validation import skip_value_checks
from host_read_spy import HostReadSpy

HIDDEN, HK, HV, DK, DV = 32, 2, 4, 8, 8


def make_layer(backend="torch", dtype=torch.float64, layout="split"):
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, backend=backend, dtype=dtype, projection_layout=layout)
    with torch.no_grad():   # slow decay: a state that leaks or is lost shows
        layer.A_log.uniform_(-4, -2)
        layer.conv1d.weight.normal_(0, 0.3)
    return layer.eval()


def filled_pool(layer, rows, seed=1):
    pool = layer.new_state(rows)
    g = torch.Generator().manual_seed(seed)
    pool.conv_state.copy_(torch.randn(pool.conv_state.shape, generator=g))
    pool.recurrent_state.copy_(torch.randn(pool.recurrent_state.shape, generator=g) * 0.3)
    return pool


def copy_of(pool):
    return GDNState(pool.conv_state.clone(), pool.recurrent_state.clone())


def alone(layer, x, row):
    """The oracle: one sequence through the GDNState path, from ``row`` (a GDNState of one row) or None."""
    with torch.no_grad():
        return layer(x, state=row, output_state=True)


def row_of(pool, r):
    return GDNState(pool.conv_state[r:r + 1], pool.recurrent_state[r:r + 1])


def err(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


LENS = [5, 1, 3, 0, 2, 1]
SLOTS = [4, 1, -1, 0, 2, 6]


def packed(lens=LENS, seed=2, dtype=torch.float64):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return torch.randn(1, sum(lens), HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(seed)), cu


@pytest.mark.parametrize("layout", ["split", "fused"])
def test_pool_rows_in_place_equal_each_sequence_alone_and_other_rows_are_untouched(layout):
    layer = make_layer(layout=layout)
    pool = filled_pool(layer, 8)
    before = copy_of(pool)
    x, cu = packed()                       # prefill and decode tokens of six sequences, one empty, one padding
    slots = torch.tensor(SLOTS)
    with torch.no_grad():
        y = layer(x, cu_seqlens=cu, state=pool, state_slots=slots)
    for i, s in enumerate(SLOTS):
        xi, yi = x[:, cu[i]:cu[i + 1]], y[:, cu[i]:cu[i + 1]]
        if s < 0:
            assert yi.abs().max() == 0 if yi.numel() else True
            continue
        if LENS[i] == 0:
            assert torch.equal(pool.recurrent_state[s], before.recurrent_state[s])
            continue
        want_y, want = alone(layer, xi, row_of(before, s))
        assert err(yi, want_y) < 1e-12
        assert err(pool.recurrent_state[s], want.recurrent_state[0]) < 1e-12
        assert err(pool.conv_state[s], want.conv_state[0]) < 1e-12
    for r in (3, 5, 7):                    # rows no sequence names
        assert torch.equal(pool.conv_state[r], before.conv_state[r])
        assert torch.equal(pool.recurrent_state[r], before.recurrent_state[r])


def test_rows_without_cu_seqlens_and_a_zeroed_row_is_a_new_sequence():
    layer = make_layer()
    pool = filled_pool(layer, 3)
    pool.conv_state[2].zero_()
    pool.recurrent_state[2].zero_()
    before = copy_of(pool)
    x = torch.randn(3, 4, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x, state=pool, state_slots=torch.tensor([2, -1, 0], dtype=torch.int32))
    new_y, new = alone(layer, x[2:3], None)
    cont_y, cont = alone(layer, x[0:1], None)          # row 2 was zero: no state
    assert err(y[0], cont_y[0]) < 1e-12 and err(pool.recurrent_state[2], cont.recurrent_state[0]) < 1e-12
    old_y, old = alone(layer, x[2:3], row_of(before, 0))
    assert err(y[2], old_y[0]) < 1e-12 and err(pool.recurrent_state[0], old.recurrent_state[0]) < 1e-12
    assert y[1].abs().max() == 0 and torch.equal(pool.recurrent_state[1], before.recurrent_state[1])
    assert new_y.shape == cont_y.shape


def test_decode_steps_in_the_pool_follow_a_prefill_in_the_pool():
    layer = make_layer()
    pool = layer.new_state(4)
    x, cu = packed([6, 9], seed=3)
    steps = torch.randn(3, 2, 1, HIDDEN, dtype=torch.float64)     # 3 steps of [B = 2, 1 token]
    slots = torch.tensor([3, 1])
    with torch.no_grad():
        layer(x, cu_seqlens=cu, state=pool, state_slots=slots)
        outs = [layer(steps[t], state=pool, state_slots=slots) for t in range(3)]
    for i in range(2):
        seq = torch.cat([x[:, cu[i]:cu[i + 1]]] + [steps[t, i:i + 1] for t in range(3)], 1)
        want_y, want = alone(layer, seq, None)
        got = torch.cat([o[i:i + 1] for o in outs], 1)
        assert err(got, want_y[:, -3:]) < 1e-12
        assert err(pool.recurrent_state[slots[i]], want.recurrent_state[0]) < 1e-12


@pytest.mark.parametrize("every, lens, m", [(1, LENS, 4), (64, [150, 64, 0, 129, 10, 200], 3)],
                         ids=["speculative_E1", "prefix_E64"])
def test_checkpoints_hold_the_state_after_every_e_th_token(every, lens, m):
    layer = make_layer()
    n = len(lens)
    pool = filled_pool(layer, 8 + n * m)
    before = copy_of(pool)
    x, cu = packed(lens, seed=4)
    slots = torch.tensor(SLOTS)
    ck = (8 + torch.arange(n * m)).reshape(n, m)
    ck[0, 1] = -1
    with torch.no_grad():
        plain_pool = copy_of(before)
        y_plain = layer(x, cu_seqlens=cu, state=plain_pool, state_slots=slots)
        y = layer(x, cu_seqlens=cu, state=pool, state_slots=slots, checkpoint_slots=ck, checkpoint_every=every)
    assert err(y, y_plain) < 1e-12
    assert err(pool.recurrent_state[:8], plain_pool.recurrent_state[:8]) < 1e-12
    written = 0
    for i in range(n):
        for j in range(m):
            r = int(ck[i, j])
            if r < 0:
                continue
            if SLOTS[i] < 0 or lens[i] < (j + 1) * every:     # padding, or past the sequence's end: untouched
                assert torch.equal(pool.recurrent_state[r], before.recurrent_state[r])
                assert torch.equal(pool.conv_state[r], before.conv_state[r])
                continue
            _, want = alone(layer, x[:, cu[i]:cu[i] + (j + 1) * every], row_of(before, SLOTS[i]))
            assert err(pool.recurrent_state[r], want.recurrent_state[0]) < 1e-12
            assert err(pool.conv_state[r], want.conv_state[0]) < 1e-12
            written += 1
    assert written >= 5


def test_speculative_verify_then_continue_from_the_last_accepted_tokens_row():
    """Verify K = 3 drafts per sequence in one call, accept 1 and 2, continue from their checkpoint rows:
    equals plain decoding of the accepted tokens."""
    layer = make_layer()
    pool = filled_pool(layer, 10)
    before = copy_of(pool)
    drafts = torch.randn(1, 6, HIDDEN, dtype=torch.float64)
    cu = torch.tensor([0, 3, 6])
    slots = torch.tensor([0, 1])
    ck = torch.tensor([[2, 3, 4], [5, 6, 7]])
    nxt = torch.randn(2, 1, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        layer(drafts, cu_seqlens=cu, state=pool, state_slots=slots, checkpoint_slots=ck, checkpoint_every=1)
        accepted_rows = torch.tensor([2, 6])         # 1 token of sequence 0, 2 of sequence 1
        y = layer(nxt, state=pool, state_slots=accepted_rows)
    for i, keep in enumerate((1, 2)):
        seq = torch.cat([drafts[:, cu[i]:cu[i] + keep], nxt[i:i + 1]], 1)
        want_y, want = alone(layer, seq, row_of(before, i))
        assert err(y[i], want_y[0, -1:]) < 1e-12
        assert err(pool.recurrent_state[accepted_rows[i]], want.recurrent_state[0]) < 1e-12


def test_the_triton_kernels_under_the_interpreter_give_the_torch_pool_results(triton_cpu_backend):
    ref, fast = make_layer(dtype=torch.float32), make_layer(backend=triton_cpu_backend, dtype=torch.float32)
    x, cu = packed(dtype=torch.float32)
    slots, ck = torch.tensor(SLOTS), torch.arange(8, 8 + 12).reshape(6, 2)
    pools = []
    with torch.no_grad():
        for layer in (ref, fast):
            pool = filled_pool(layer, 20)
            y = layer(x, cu_seqlens=cu, state=pool, state_slots=slots, checkpoint_slots=ck, checkpoint_every=1)
            pools.append((y, pool))
    (y0, p0), (y1, p1) = pools
    assert err(y1, y0) < 1e-5 and err(p1.recurrent_state, p0.recurrent_state) < 1e-5
    assert err(p1.conv_state, p0.conv_state) < 1e-5


def test_no_value_of_slots_checkpoints_or_cu_seqlens_is_read_on_the_host():
    layer = make_layer()
    pool = filled_pool(layer, 20)
    x, cu = packed()
    slots, ck = torch.tensor(SLOTS), torch.arange(8, 8 + 12).reshape(6, 2)
    with torch.no_grad(), skip_value_checks(), HostReadSpy() as spy:
        layer(x, cu_seqlens=cu, state=pool, state_slots=slots, checkpoint_slots=ck, checkpoint_every=1)
        layer(x[:, :6].reshape(6, 1, HIDDEN), state=pool, state_slots=slots)
    assert spy.found == []


def test_new_state_shapes_dtypes_and_device():
    for dtype, want in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float64, torch.float64)):
        pool = make_layer(dtype=dtype).new_state(5)
        assert pool.conv_state.shape == (5, 2 * HK * DK + HV * DV, 3)
        assert pool.recurrent_state.shape == (5, HV, DK, DV)
        assert pool.conv_state.dtype == pool.recurrent_state.dtype == want
        assert pool.conv_state.abs().max() == 0 and pool.recurrent_state.abs().max() == 0
    with pytest.raises(ValueError, match="num_slots"):
        make_layer().new_state(0)
    with pytest.raises(TypeError, match="num_slots"):
        make_layer().new_state(2.0)


def bad_calls(layer, x, cu, pool):
    s = torch.tensor(SLOTS)
    ck = torch.zeros(6, 2, dtype=torch.long)
    return {
        "output_state": (dict(state_slots=s, output_state=True), ValueError, "output_state"),
        "slots dtype": (dict(state_slots=s.float()), TypeError, "state_slots must be int32 or int64"),
        "slots shape": (dict(state_slots=s[:4]), ValueError, r"state_slots must have shape \(6,\)"),
        "slots twice": (dict(state_slots=torch.tensor([1, 1, -1, 0, 2, 3])), ValueError, "names a row twice"),
        "slot too big": (dict(state_slots=torch.tensor([1, 9, -1, 0, 2, 3])), ValueError, "the pool has 8 rows"),
        "slot below -1": (dict(state_slots=torch.tensor([1, -2, -1, 0, 2, 3])), ValueError, "holds -2"),
        "ck shape": (dict(state_slots=s, checkpoint_slots=ck[:, 0]), ValueError, r"checkpoint_slots must be"),
        "ck too big": (dict(state_slots=s, checkpoint_slots=torch.arange(8, 20).reshape(6, 2)), ValueError,
                       "checkpoint_slots holds row"),
        "ck twice": (dict(state_slots=s, checkpoint_slots=torch.full((6, 2), 5)), ValueError,
                     "checkpoint_slots names a row twice"),
        "every alone": (dict(state_slots=s, checkpoint_every=3), ValueError, "multiple of 64"),
        "cu list": (dict(state_slots=s, cu_seqlens=[0, 12]), TypeError, "cu_seqlens"),
        "every": (dict(state_slots=s, checkpoint_slots=ck, checkpoint_every=32), ValueError, "multiple of 64"),
        "ck alone": (dict(checkpoint_slots=ck), ValueError, "checkpoint_slots needs state_slots"),
        "token_order": (dict(state_slots=s, token_order=torch.arange(x.shape[1])), ValueError, "token_order"),
        "not a pool": (dict(state_slots=s, state=None), TypeError, "GDNState pool"),
    }


@pytest.mark.parametrize("case", list(bad_calls(None, torch.zeros(1, 12, 1), None, None)))
def test_bad_pool_calls_are_refused_before_anything_is_written(case):
    layer = make_layer()
    pool = filled_pool(layer, 8)
    before = copy_of(pool)
    x, cu = packed()
    kwargs, error, match = bad_calls(layer, x, cu, pool)[case]
    kwargs.setdefault("state", pool)
    kwargs.setdefault("cu_seqlens", cu)
    with torch.no_grad(), pytest.raises(error, match=match):
        layer(x, **kwargs)
    assert torch.equal(pool.conv_state, before.conv_state)
    assert torch.equal(pool.recurrent_state, before.recurrent_state)


def test_the_pool_refuses_autograd_recording_a_wrong_pool_and_parallel_layers():
    layer = make_layer()
    pool = filled_pool(layer, 8)
    before = copy_of(pool)
    x, cu = packed()
    s = torch.tensor(SLOTS)
    with pytest.raises(ValueError, match="for inference: autograd is recording"):
        layer(x, cu_seqlens=cu, state=pool, state_slots=s)
    with torch.no_grad():
        with pytest.raises(TypeError, match="float64 with torch.float64 activations"):
            layer(x, cu_seqlens=cu, state=GDNState(pool.conv_state.float(), pool.recurrent_state.float()),
                  state_slots=s)
        with pytest.raises(ValueError, match=r"state \(a pool\) .recurrent_state must be \[num_slots, ...\]"):
            layer(x, cu_seqlens=cu, state=GDNState(pool.conv_state, pool.recurrent_state[:, :2]), state_slots=s)
        layer.sp_size = 2                     # what a layer built with an sp_group of 2 holds
        with pytest.raises(ValueError, match="not supported under sequence or context parallelism"):
            layer(x, cu_seqlens=cu, state=pool, state_slots=s)
    assert torch.equal(pool.recurrent_state, before.recurrent_state)


def test_a_pool_made_under_inference_mode_or_requiring_grad_is_refused_before_anything_is_written():
    layer = make_layer()
    x, cu = packed()
    s = torch.tensor(SLOTS)
    with torch.inference_mode():
        frozen = filled_pool(layer, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="made under torch.inference_mode"):
        layer(x, cu_seqlens=cu, state=frozen, state_slots=s)
    with torch.inference_mode():
        layer(x, cu_seqlens=cu, state=frozen, state_slots=s)       # where it was made: fine
    pool = filled_pool(layer, 8)
    before = copy_of(pool)
    pool.recurrent_state.requires_grad_(True)
    layer.requires_grad_(False)
    with pytest.raises(ValueError, match="requires grad"):
        layer(x, cu_seqlens=cu, state=pool, state_slots=s)
    assert torch.equal(pool.conv_state, before.conv_state)


def test_a_nan_in_a_row_no_sequence_names_stays_out_of_every_output_and_row():
    layer = make_layer()
    pool = filled_pool(layer, 8)
    pool.recurrent_state[0] = float("nan")        # row 0: where a padding entry's index is clamped to
    pool.conv_state[0] = float("nan")
    x, cu = packed([3, 2, 4])
    slots = torch.tensor([-1, 1, 2])
    with torch.no_grad(), skip_value_checks():
        y = layer(x, cu_seqlens=cu, state=pool, state_slots=slots, checkpoint_slots=torch.tensor([[3], [4], [5]]),
                  checkpoint_every=1)
    assert torch.isfinite(y).all() and y[:, :3].abs().max() == 0
    assert torch.isfinite(pool.recurrent_state[1:]).all() and torch.isfinite(pool.conv_state[1:]).all()


def test_calls_without_tokens_keep_every_row():
    layer = make_layer()
    pool = filled_pool(layer, 4)
    before = copy_of(pool)
    with torch.no_grad():
        y1 = layer(torch.zeros(1, 0, HIDDEN, dtype=torch.float64), cu_seqlens=torch.tensor([0, 0, 0]), state=pool,
                   state_slots=torch.tensor([0, 1]))
        y2 = layer(torch.zeros(2, 0, HIDDEN, dtype=torch.float64), state=pool, state_slots=torch.tensor([2, 3]))
    assert y1.shape == (1, 0, HIDDEN) and y2.shape == (2, 0, HIDDEN)
    assert torch.equal(pool.recurrent_state, before.recurrent_state) and torch.equal(pool.conv_state, before.conv_state)


@pytest.fixture
def fused_decode_on_cpu(monkeypatch):
    """The fused decode kernels (kernels/triton/decode.py) for CPU tensors, under Triton's interpreter; counts
    their calls, so a test sees that they ran."""
    from gdn_layer import pool as pool_module
    from gdn_layer.kernels.triton import decode
    calls = []
    real = decode.decode_step

    def counting(*args, **kwargs):
        calls.append(args[6].clone())
        return real(*args, **kwargs)
    monkeypatch.setattr(pool_module, "FUSED_DECODE_ON_CPU", True)
    monkeypatch.setattr(decode, "decode_step", counting)
    return calls


def test_the_fused_decode_step_equals_each_sequence_alone(fused_decode_on_cpu):
    layer = make_layer()
    pool = filled_pool(layer, 8)
    pool.recurrent_state[0] = float("nan")        # row 0: named by no sequence (padding reads nothing)
    pool.conv_state[0] = float("nan")
    before = copy_of(pool)
    slots = torch.tensor([5, -1, 2, 7, 3])
    x = torch.randn(5, 1, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x, state=pool, state_slots=slots)
    assert len(fused_decode_on_cpu) == 1
    assert y[1].abs().max() == 0 and torch.isfinite(y).all()
    for i, r in enumerate(slots.tolist()):
        if r < 0:
            continue
        want_y, want = alone(layer, x[i:i + 1], GDNState(before.conv_state[r:r + 1], before.recurrent_state[r:r + 1]))
        assert err(y[i:i + 1], want_y) < 1e-12
        assert err(pool.recurrent_state[r], want.recurrent_state[0]) < 1e-12
        assert err(pool.conv_state[r], want.conv_state[0]) < 1e-12
    untouched = [r for r in range(8) if r not in slots.tolist()]
    assert torch.equal(pool.recurrent_state[untouched[1:]], before.recurrent_state[untouched[1:]])
    assert torch.equal(pool.conv_state[untouched[1:]], before.conv_state[untouched[1:]])
    assert torch.isnan(pool.recurrent_state[0]).all() and torch.isnan(pool.conv_state[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_decode_step_equals_the_op_by_op_pool_step(fused_decode_on_cpu, monkeypatch, dtype):
    """Low precision: the fused kernels round where the op-by-op path rounds (conv output, beta, o)."""
    from gdn_layer import pool as pool_module
    layer = make_layer(dtype=dtype)
    pools = [filled_pool(layer, 6), filled_pool(layer, 6)]
    slots = torch.tensor([4, 0, -1])
    xs = torch.randn(3, 3, 1, HIDDEN, dtype=dtype)
    outs = []
    for fused, pool in zip((True, False), pools):
        monkeypatch.setattr(pool_module, "FUSED_DECODE_ON_CPU", fused)
        with torch.no_grad():
            outs.append(torch.stack([layer(xs[t], state=pool, state_slots=slots) for t in range(3)]))
    assert len(fused_decode_on_cpu) == 3

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(outs[0], outs[1]) < tol
    assert rel(pools[0].recurrent_state, pools[1].recurrent_state) < tol
    assert rel(pools[0].conv_state, pools[1].conv_state) < tol


@pytest.mark.parametrize("allow_neg_eigval", [True, False])
def test_a_subclass_whose_gate_differs_decodes_op_by_op(fused_decode_on_cpu, allow_neg_eigval):
    """OLMo-Hybrid's block doubles beta (``allow_neg_eigval``), which the fused kernels do not: its pool decode
    step runs the op-by-op path, from the GDNState oracle of its own class; without it, the fused one."""
    from gdn_layer.hf import HFOlmoHybridGatedDeltaNet
    torch.manual_seed(0)
    layer = HFOlmoHybridGatedDeltaNet(HIDDEN, HK, HV, DK, DV, allow_neg_eigval=allow_neg_eigval, backend="torch",
                                      dtype=torch.float64).eval()
    pool = filled_pool(layer, 4)
    before = copy_of(pool)
    slots = torch.tensor([3, 0])
    x = torch.randn(2, 1, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        y = GatedDeltaNet.forward(layer, x, state=pool, state_slots=slots)
    assert len(fused_decode_on_cpu) == (0 if allow_neg_eigval else 1)
    for i, r in enumerate(slots.tolist()):
        with torch.no_grad():
            want_y, want = GatedDeltaNet.forward(layer, x[i:i + 1], state=GDNState(
                before.conv_state[r:r + 1], before.recurrent_state[r:r + 1]), output_state=True)
        assert err(y[i:i + 1], want_y) < 1e-12
        assert err(pool.recurrent_state[r], want.recurrent_state[0]) < 1e-12


def half_beta(layer, *args, **kwargs):
    """``GatedDeltaNet._conv_gate`` with beta halved: a gate the fused decode kernels do not compute."""
    q, k, v, g, beta, conv_state = GatedDeltaNet._conv_gate(layer, *args, **kwargs)
    return q, k, v, g, beta * 0.5, conv_state


class HalfBeta(GatedDeltaNet):
    _conv_gate = half_beta


@pytest.mark.parametrize("where", ["subclass", "instance"])
def test_a_replaced_conv_gate_decodes_op_by_op_like_its_own_state_path(fused_decode_on_cpu, where):
    """The fused kernels compute the library's own conv/gate and delta rule: a class or an instance replacing
    either decodes op by op, equal to its own ``GDNState`` path (which runs the replacement)."""
    torch.manual_seed(0)
    layer = (HalfBeta if where == "subclass" else GatedDeltaNet)(HIDDEN, HK, HV, DK, DV, backend="torch",
                                                                 dtype=torch.float64).eval()
    if where == "instance":
        layer._conv_gate = lambda *a, **kw: half_beta(layer, *a, **kw)
    pool = filled_pool(layer, 4)
    before = copy_of(pool)
    slots = torch.tensor([3, 0])
    x = torch.randn(2, 1, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        y = layer(x, state=pool, state_slots=slots)
    assert len(fused_decode_on_cpu) == 0
    for i, r in enumerate(slots.tolist()):
        with torch.no_grad():
            want_y, want = layer(x[i:i + 1], state=GDNState(before.conv_state[r:r + 1],
                                                            before.recurrent_state[r:r + 1]), output_state=True)
        assert err(y[i:i + 1], want_y) < 1e-12
        assert err(pool.recurrent_state[r], want.recurrent_state[0]) < 1e-12


def test_the_fused_decode_step_reads_slots_given_as_a_strided_view(fused_decode_on_cpu):
    """A column of a per-request table (an int64 view with stride 2) names the same rows as its copy."""
    layer = make_layer()
    pools = [filled_pool(layer, 8), filled_pool(layer, 8)]
    table = torch.tensor([[5, 900], [2, 901], [-1, 902], [0, 903]])
    x = torch.randn(4, 1, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        y_view = layer(x, state=pools[0], state_slots=table[:, 0])
        y_copy = layer(x, state=pools[1], state_slots=table[:, 0].clone())
    assert len(fused_decode_on_cpu) == 2
    assert torch.equal(y_view, y_copy)
    assert torch.equal(pools[0].recurrent_state, pools[1].recurrent_state)
    assert torch.equal(pools[0].conv_state, pools[1].conv_state)
