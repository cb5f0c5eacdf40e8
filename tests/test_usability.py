"""What a new user met (README-only trial): autocast, warmup's dtype, backend registration, queries."""
import dataclasses

import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import available_backends, registry, warmup


def test_fp32_layer_under_bf16_autocast_after_a_linear_layer():
    torch.manual_seed(0)
    layer, lin = GatedDeltaNet(64, 2, 4, 16, 16), torch.nn.Linear(64, 64)
    x, cu = torch.randn(1, 30, 64), torch.tensor([0, 10, 30])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        assert h.dtype == torch.bfloat16
        y = layer(h, cu_seqlens=cu)
    y.float().square().mean().backward()
    ref = layer(lin(x).float(), cu_seqlens=cu)
    assert y.dtype == torch.bfloat16 and all(p.grad is not None for p in layer.parameters())
    assert float((y.float() - ref).detach().norm() / ref.detach().norm()) < 3e-2


def test_warmup_builds_for_another_activation_dtype_under_autocast():
    layer = GatedDeltaNet(32, 1, 2, 8, 8)
    assert warmup(layer, dtype=torch.bfloat16) > 0
    assert all(p.grad is None for p in layer.parameters())


def test_available_backends_on_a_device_this_torch_cannot_use_is_a_list():
    names = available_backends("cuda")
    assert "torch" in names and (torch.cuda.is_available() or names == ["torch"])


def test_a_backend_whose_available_returns_a_bool_registers():
    b = dataclasses.replace(registry.backend_by_name("torch"), name="bool_avail", priority=-5,
                            available=lambda device: device.type == "cpu")
    registry.register_backend(b)
    try:
        assert "bool_avail" in available_backends("cpu")
        assert registry.resolve_backend("bool_avail", "cpu").name == "bool_avail"
    finally:
        registry._BACKENDS.pop("bool_avail")


def test_bad_inputs_found_by_the_adversarial_review_raise_naming_the_argument():
    import pytest
    from gdn_layer.kernels import causal_conv1d, gated_rms_norm
    layer = GatedDeltaNet(32, 1, 2, 8, 8)
    with pytest.raises(ValueError, match="batch size"):
        layer(torch.randn(0, 5, 32))
    with pytest.raises(ValueError, match="batch size"):
        causal_conv1d(torch.randn(0, 5, 8), torch.randn(8, 4))
    x = torch.randn(1, 5, 32)
    x[0, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="hidden_states contains NaN or inf"):
        layer(x)
    with pytest.raises(ValueError, match="cu_seqlens.*meta"):
        layer(torch.randn(1, 5, 32), cu_seqlens=torch.empty(3, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="x must be a floating"):
        gated_rms_norm(torch.ones(1, 2, dtype=torch.int64), torch.ones(1, 2), torch.ones(2))
    with pytest.raises(TypeError, match="eps"):
        gated_rms_norm(torch.ones(1, 2), torch.ones(1, 2), torch.ones(2), eps="a")
    with pytest.raises(ValueError, match="eps must be positive"):
        gated_rms_norm(torch.ones(1, 2), torch.ones(1, 2), torch.ones(2), eps=0.0)


def test_triton_l2norm_keeps_float64():
    from gdn_layer.kernels.triton.l2norm import l2norm_bwd, l2norm_fwd
    x = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    ref = x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)
    assert l2norm_fwd(x).dtype == torch.float64 and torch.allclose(l2norm_fwd(x), ref, rtol=1e-14, atol=0)
    dy = torch.randn_like(x)
    x_ = x.clone().requires_grad_(True)
    (x_ * torch.rsqrt(x_.square().sum(-1, keepdim=True) + 1e-6)).backward(dy)
    assert torch.allclose(l2norm_bwd(x, dy), x_.grad, rtol=1e-12, atol=1e-14)


def test_triton_l2norm_matches_torch_on_strided_views_fwd_and_bwd():
    """Our q/k L2-norm kernel (used by the CUDA backends before the chunk kernel), under the
    interpreter on CPU: a strided view of a wider buffer, rows not a multiple of the block."""
    from gdn_layer.kernels.triton.l2norm import l2norm_bwd, l2norm_fwd
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, 7, 3 * 24 + 5, generator=g)
    x = buf[..., 5:5 + 3 * 24].unflatten(-1, (3, 24))      # [2, 7, 3, 24], row stride 77
    x_ = x.detach().clone().requires_grad_(True)
    ref = x_ * torch.rsqrt(x_.square().sum(-1, keepdim=True) + 1e-6)
    dy = torch.randn(ref.shape, generator=g)
    ref.backward(dy)
    torch.testing.assert_close(l2norm_fwd(x), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l2norm_bwd(x, dy), x_.grad, rtol=1e-5, atol=1e-6)


def test_warmup_without_states_runs_only_the_stateless_training_path():
    """include_states=False: every delta-rule call is a chunk call without initial or returned state
    (one compiled variant); the default also runs the state variants and the decode path."""
    calls = []
    torch_b = registry.backend_by_name("torch")

    def logged(kind):
        fn = getattr(torch_b, kind)

        def run(*args, initial_state=None, output_final_state=False, **kw):
            calls.append((kind, initial_state is not None, output_final_state))
            return fn(*args, initial_state=initial_state, output_final_state=output_final_state, **kw)
        return run

    registry.register_backend(dataclasses.replace(
        torch_b, name="logged_delta", priority=-5, chunk_gated_delta_rule=logged("chunk_gated_delta_rule"),
        recurrent_gated_delta_rule=logged("recurrent_gated_delta_rule")))
    try:
        layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="logged_delta")
        warmup(layer, include_states=False)
        assert calls and set(calls) == {("chunk_gated_delta_rule", False, False)}
        calls.clear()
        warmup(layer)
        assert {c[0] for c in calls} == {"chunk_gated_delta_rule", "recurrent_gated_delta_rule"}
        assert {c[1:] for c in calls} == {(False, False), (False, True), (True, True), (True, False)}
    finally:
        registry._BACKENDS.pop("logged_delta", None)


def test_warmup_runs_a_pack_of_each_sequence_count_the_backend_compiles_for():
    """A backend whose compiled variant depends on the sequence count (FlashQLA's V block) lists the
    counts in ``warmup_sequence_counts``: warmup runs each with every state combination it builds."""
    seen, asked = [], []
    torch_b = registry.backend_by_name("torch")

    def chunk(*args, initial_state=None, output_final_state=False, cu=None, **kw):
        seen.append((1 if cu is None else cu.numel() - 1, initial_state is not None, output_final_state))
        return torch_b.chunk_gated_delta_rule(*args, initial_state=initial_state,
                                              output_final_state=output_final_state, cu=cu, **kw)

    def counts(hv):
        asked.append(hv)
        return (1, 5, 2)

    registry.register_backend(dataclasses.replace(
        torch_b, name="counted", priority=-5, chunk_gated_delta_rule=chunk, warmup_sequence_counts=counts,
        dense_as_packed=True))
    try:
        layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="counted")
        warmup(layer, include_states=False)
        assert asked == [2] and {s for s in seen} == {(n, False, False) for n in (1, 2, 5)}
        seen.clear()
        warmup(layer, include_decode=False)
        assert {s for s in seen} == {(n, a, b) for n in (1, 2, 5) for a in (False, True) for b in (False, True)}
    finally:
        registry._BACKENDS.pop("counted", None)


def test_warmup_runs_the_packed_training_calls_once_more_as_a_capture_runs_them():
    """A backend whose captured calls take other kernels (FlashQLA hands the chunk op to fla during a CUDA
    graph capture) names that mode ``as_in_capture``: warmup runs every packed training call under it
    too (forward and backward inside it), so a capture after warmup compiles and autotunes nothing."""
    import contextlib
    torch_b = registry.backend_by_name("torch")
    mode, seen = [], []

    @contextlib.contextmanager
    def as_in_capture():
        mode.append("capture")
        try:
            yield
        finally:
            mode.pop()

    def chunk(*args, initial_state=None, output_final_state=False, cu=None, **kw):
        seen.append(("fwd", bool(mode), initial_state is not None, output_final_state))
        return torch_b.chunk_gated_delta_rule(*args, initial_state=initial_state,
                                              output_final_state=output_final_state, cu=cu, **kw)

    registry.register_backend(dataclasses.replace(
        torch_b, name="captured", priority=-5, chunk_gated_delta_rule=chunk, as_in_capture=as_in_capture))
    try:
        layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="captured")
        warmup(layer, include_decode=False)
        assert {s for s in seen if s[0] == "fwd" and s[1]} == {("fwd", True, a, b) for a in (False, True)
                                                             for b in (False, True)}
        assert ("fwd", False, False, False) in seen           # and the eager calls
        seen.clear()
        warmup(GatedDeltaNet(32, 1, 2, 8, 8, backend="torch"))       # no as_in_capture: no captured job
        assert not mode
    finally:
        registry._BACKENDS.pop("captured", None)


def test_warmup_calls_the_module_so_its_hooks_run():
    """warmup goes through ``layer(...)``: forward hooks run (accelerate's, FSDP2's parameter gathering), and
    an instance-level forward (a hook library's wrapper) is what it calls."""
    layer = GatedDeltaNet(32, 1, 2, 8, 8)
    pre = []
    layer.register_forward_pre_hook(lambda m, args, kwargs: pre.append(1) and None, with_kwargs=True)
    wrapped = []
    inner = layer.forward

    def wrapper(*args, **kwargs):
        wrapped.append(1)
        return inner(*args, **kwargs)
    layer.forward = wrapper
    warmup(layer, include_decode=False)
    assert pre and len(wrapped) == len(pre) and layer.__dict__["forward"] is wrapper


def _warmup_under_fully_shard(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 2, 16, 16, backend="torch")
    fully_shard(layer, mesh=init_device_mesh("cpu", (2,)))
    warmup(layer, include_decode=False)
    x = torch.randn(1, 20, 32)
    layer(x, cu_seqlens=torch.tensor([0, 7, 20])).sum().backward()
    return True


def test_warmup_of_an_fsdp2_sharded_layer():
    """FSDP2 gathers the sharded parameters in a forward pre-hook: warmup must call the module."""
    from dist_utils import run_distributed
    assert run_distributed(_warmup_under_fully_shard, 2) == [True, True]


def test_warmup_children_run_their_share_and_a_failing_child_is_only_logged(caplog):
    """The child-process path of warmup (used on CUDA to build kernels in parallel), run here with the
    torch backend on CPU: children rebuild the layer from the spec and run their jobs; a child that
    fails is logged as a warning and warmup goes on."""
    import importlib
    import logging
    wmod = importlib.import_module("gdn_layer.kernels.warmup")
    layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="torch")
    jobs = wmod._jobs(layer, include_decode=True, include_states=True)
    assert {j[0] for j in jobs} == {"packed", "dense", "decode", "pool"}
    spec = {"args": [32, 1, 2, 8, 8], "kwargs": {"backend": "torch"}, "param_dtype": "float32",
            "dtype": "float32", "device": "cpu"}
    with caplog.at_level(logging.WARNING, logger="gdn_layer.kernels"):
        wmod._finish_children(wmod._start_children(spec, jobs[:3], workers=2), wait=True)
    assert not [r for r in caplog.records if "child process failed" in r.message]
    bad = {**spec, "args": [32, 3, 2, 8, 8]}        # num_v_heads not a multiple of num_k_heads: ValueError
    with caplog.at_level(logging.WARNING, logger="gdn_layer.kernels"):
        wmod._finish_children(wmod._start_children(bad, jobs[:1], workers=1), wait=True)
    assert [r for r in caplog.records if "child process failed" in r.message and "ValueError" in r.message]
    caplog.clear()
    children = wmod._start_children(spec, jobs * 20, workers=1)      # still importing torch when stopped
    wmod._finish_children(children, wait=False)
    assert children[0][0].returncode is not None and not caplog.records
    with pytest.raises(ValueError, match="workers"):
        warmup(layer, workers=-1)
    assert wmod._spec(layer, torch.float32) is None      # CPU / torch backend: no children


def test_warmup_of_a_float64_layer_builds_its_state_variants_with_float64_states():
    """The layer takes float64 states with float64 activations only: warmup's states follow that rule."""
    layer = GatedDeltaNet(32, 1, 2, 8, 8, dtype=torch.float64)
    assert warmup(layer) > 0


def test_warmup_leaves_the_random_state_alone():
    layer = GatedDeltaNet(32, 1, 2, 8, 8)
    torch.manual_seed(3)
    want = torch.randn(4)
    torch.manual_seed(3)
    warmup(layer)
    assert torch.equal(torch.randn(4), want)


def test_warmup_sequence_counts_are_checked_and_each_runs_once():
    """A registered backend's ``warmup_sequence_counts`` is the user's code: a count that is not a
    positive int is named before any call runs, and a count listed twice is built once."""
    seen = []
    torch_b = registry.backend_by_name("torch")

    def chunk(*args, cu=None, **kw):
        seen.append(1 if cu is None else cu.numel() - 1)
        return torch_b.chunk_gated_delta_rule(*args, cu=cu, **kw)

    def layer_with(counts):
        registry.register_backend(dataclasses.replace(
            torch_b, name="counts_checked", priority=-5, chunk_gated_delta_rule=chunk,
            warmup_sequence_counts=lambda hv: counts, dense_as_packed=True))
        return GatedDeltaNet(32, 1, 2, 8, 8, backend="counts_checked")

    try:
        for bad, err in [((0,), ValueError), ((3, -1), ValueError), ((1.5,), TypeError), ((True,), TypeError),
                         (None, TypeError), ("3", TypeError)]:
            seen.clear()
            with pytest.raises(err, match=r"counts_checked.*warmup_sequence_counts"):
                warmup(layer_with(bad), include_states=False)
            assert seen == []
        warmup(layer_with([5, 1, 5, 2, torch.tensor(5)]), include_states=False)
        # packs of 1, 2 and 5 sequences once each, and the dense batch of 2 rows (a pack of 2 as well)
        assert set(seen) == {1, 2, 5} and seen.count(5) == seen.count(1) and seen.count(2) == 2 * seen.count(1)
    finally:
        registry._BACKENDS.pop("counts_checked", None)


def test_warmup_goes_on_in_this_process_when_a_child_cannot_start(monkeypatch, caplog):
    """Children only build ahead: when one cannot be started (no interpreter at sys.executable, a
    child dying before it reads its jobs: BrokenPipeError), those already started are stopped, a
    warning says so, and warmup runs every call in this process."""
    import importlib
    import logging
    import subprocess
    wmod = importlib.import_module("gdn_layer.kernels.warmup")
    layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="torch")
    spec = {"args": [32, 1, 2, 8, 8], "kwargs": {"backend": "torch"}, "param_dtype": "float32",
            "dtype": "float32", "device": "cpu"}
    real, started = subprocess.Popen, []

    def second_fails(*args, **kwargs):
        if started:
            raise OSError("cannot start a second interpreter")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", second_fails)
    monkeypatch.setattr(wmod, "_spec", lambda layer, dtype: spec)       # the CUDA-only path, on CPU
    monkeypatch.setattr(wmod, "COLD_FIRST_CALL_S", 0.0)                 # as with cold disk caches
    with caplog.at_level(logging.WARNING, logger="gdn_layer.kernels"):
        assert warmup(layer, workers=2, include_decode=False) > 0
    assert len(started) == 1 and started[0].poll() is not None           # the one started was stopped
    assert [r for r in caplog.records if "could not start" in r.message]


def test_warmup_logs_a_child_whose_error_output_is_not_utf8_and_stops_the_others(monkeypatch, caplog):
    """A compiler may write bytes that are not UTF-8 to a child's stderr: the child's failure is still
    only a warning (its output with the bad bytes replaced), not an error out of warmup that would skip
    stopping the other children."""
    import importlib
    import logging
    import subprocess
    import sys
    wmod = importlib.import_module("gdn_layer.kernels.warmup")
    layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="torch")
    real, started = subprocess.Popen, []
    scripts = ["import sys; sys.stderr.buffer.write(b'ptxas \\xff\\xfe said no\\n'); sys.exit(3)",
               "import time; time.sleep(120)"]

    def stand_in(args, *rest, **kwargs):          # the first child fails at once, the second is still building
        started.append(real([sys.executable, "-c", scripts[len(started)]], *rest, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", stand_in)
    monkeypatch.setattr(wmod, "_spec", lambda layer, dtype: {"stand-in": True})
    monkeypatch.setattr(wmod, "COLD_FIRST_CALL_S", 1e9)                 # warm: the children are stopped
    monkeypatch.setattr(wmod, "_run_jobs", lambda layer, dtype, jobs: started[0].wait())
    with caplog.at_level(logging.WARNING, logger="gdn_layer.kernels"):
        warmup(layer, workers=2)
    assert len(started) == 2 and started[0].returncode == 3 and started[1].poll() is not None
    assert [r for r in caplog.records if "child process failed (rc 3)" in r.message and "ptxas" in r.message
            and "said no" in r.message]


def test_warmup_children_build_the_other_calls_and_are_waited_for_only_when_caches_are_cold(monkeypatch):
    """The children get every call but the first (a dense batch left out where the backend runs it as
    a pack) and start before this process runs the first call. Cold caches (that call slower than
    COLD_FIRST_CALL_S): this process waits for them, then runs the other calls. Warm: they are stopped."""
    import dataclasses
    import importlib
    wmod = importlib.import_module("gdn_layer.kernels.warmup")
    layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="torch")
    events = []
    real_run = wmod._run_jobs
    monkeypatch.setattr(wmod, "_spec", lambda layer, dtype: {"stand-in": True})
    monkeypatch.setattr(wmod, "_run_jobs", lambda layer, dtype, jobs: (events.append(("run", len(jobs))),
                                                                        real_run(layer, dtype, jobs)))
    monkeypatch.setattr(wmod, "_start_children", lambda spec, jobs, workers: events.append(
        ("children", sorted({j[0] for j in jobs}), len(jobs), workers)) or ["c"])
    monkeypatch.setattr(wmod, "_finish_children", lambda children, wait: events.append(("finish", wait)))
    jobs = wmod._jobs(layer, include_decode=True, include_states=True)
    n, dense = len(jobs), sum(j[0] == "dense" for j in jobs)
    assert jobs[0][0] == "packed" and dense > 0
    monkeypatch.setattr(wmod, "COLD_FIRST_CALL_S", 1e9)                 # warm: the first call is quick
    warmup(layer, workers=3)
    assert events == [("children", ["decode", "dense", "packed", "pool"], n - 1, 3), ("run", 1), ("finish", False),
                      ("run", n - 1), ("finish", False)]
    events.clear()
    monkeypatch.setattr(wmod, "COLD_FIRST_CALL_S", 0.0)                 # cold
    torch_b = registry.backend_by_name("torch")
    monkeypatch.setattr(wmod, "_backend", lambda layer: dataclasses.replace(torch_b, dense_as_packed=True))
    warmup(layer, workers=3)
    assert events == [("children", ["decode", "packed", "pool"], n - 1 - dense, 3), ("run", 1), ("finish", True),
                      ("run", n - 1), ("finish", False)]


def test_warmup_names_a_dtype_the_layer_cannot_run_and_runs_under_inference_mode():
    layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="torch")
    for bad in (torch.int32, "bf16"):
        with pytest.raises(TypeError, match="dtype"):
            warmup(layer, dtype=bad)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        warmup(layer, dtype=torch.float64)             # autocast has no float64; the layer takes fp32
    with pytest.raises(ValueError, match="dtype torch.float32"):
        warmup(GatedDeltaNet(32, 1, 2, 8, 8, backend="torch", dtype=torch.bfloat16), dtype=torch.float32)
    with torch.inference_mode():                       # a serving process: the backward is built too
        assert warmup(layer, include_decode=False) > 0


def test_warmup_default_workers_are_half_the_cpus(monkeypatch):
    import importlib
    wmod = importlib.import_module("gdn_layer.kernels.warmup")
    monkeypatch.setattr(wmod.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")       # one process of the machine builds at a time
    assert wmod._default_workers() == 8
    monkeypatch.setattr(wmod.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert wmod._default_workers() == 3


def test_a_captured_job_on_a_backend_without_as_in_capture_runs_plainly():
    """A "captured" job reaching a layer whose backend has no ``as_in_capture`` (a child process rebuilding a
    layer by backend name) runs as a plain packed call instead of failing."""
    import importlib
    wmod = importlib.import_module("gdn_layer.kernels.warmup")
    layer = GatedDeltaNet(32, 1, 2, 8, 8, backend="torch")
    wmod._run_jobs(layer, torch.float32, [("captured", 2, False, False, True)])


@pytest.mark.parametrize("layout, name", [("split", "in_proj_z"), ("split", "in_proj_a"), ("split", "in_proj_qkv"),
                                          ("fused", "in_proj_ba"), ("fused", "in_proj_qkvz")])
def test_one_input_projection_cast_apart_raises_naming_it_before_any_gemm(layout, name):
    """A single input projection in another dtype than the input (``layer.in_proj_z.to(torch.bfloat16)``) is a
    TypeError naming that projection, raised before anything runs (it was torch's "expected m1 and m2 to have
    the same dtype" from inside the GEMM); under autocast the projections' dtypes do not matter."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(12, 2, 4, 8, 5, projection_layout=layout)
    getattr(layer, name).to(torch.bfloat16)
    x = torch.randn(1, 10, 12)
    launched = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, a: launched.append(m))
    try:
        with pytest.raises(TypeError, match=f"{name}.weight is torch.bfloat16 but hidden_states is torch.float32"):
            layer(x)
    finally:
        handle.remove()
    assert launched == [layer]          # no submodule ran
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    ref = GatedDeltaNet(12, 2, 4, 8, 5, projection_layout=layout)
    ref.load_state_dict(layer.state_dict())      # (loads the bf16 weights into fp32 parameters)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
    assert torch.equal(y, want)


def test_sizes_from_a_numpy_config_are_accepted_as_ints():
    """Integral numbers of any type (numpy's ``int64`` from a parsed config) are sizes; bool and float are not."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    layer = GatedDeltaNet(np.int64(12), np.int32(2), np.int64(4), 8, np.uint8(5))
    assert all(type(v) is int for v in (layer.hidden_size, layer.num_k_heads, layer.num_v_heads, layer.head_v_dim,
                                         layer.value_dim, layer.conv_dim))
    ref = GatedDeltaNet(12, 2, 4, 8, 5)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(1, 10, 12)
    assert torch.equal(layer(x), ref(x))
    for bad, kind in ((12.0, "float"), (True, "bool"), (np.float32(12), "float32")):
        with pytest.raises(TypeError, match=f"hidden_size must be an int, got {kind}"):
            GatedDeltaNet(bad, 2, 4, 8, 5)
