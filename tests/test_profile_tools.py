"""The GPU profilers' timeline arithmetic (benchmarks/profile_sp.py, benchmarks/profile_finetune.py,
benchmarks/profile_layer.py's --gaps / --loop / --why) on hand-made traces, and bench_host_cost.py's attribution
of host time to packages (on the CPU): the numbers they report in docs/performance.md come from these
functions."""
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import profile_sp  # noqa: E402


def brute_union(intervals, step=1):
    covered = set()
    for s, e in intervals:
        covered.update(range(s, e, step))
    return len(covered)


@pytest.mark.parametrize("seed", range(5))
def test_union_and_intersection_match_a_brute_force_count(seed):
    rnd = random.Random(seed)
    a = [(s, s + rnd.randint(1, 30)) for s in (rnd.randint(0, 200) for _ in range(12))]
    b = [(s, s + rnd.randint(1, 30)) for s in (rnd.randint(0, 200) for _ in range(9))]
    assert profile_sp.union(a) == brute_union(a)
    both = len({t for s, e in a for t in range(s, e)} & {t for s, e in b for t in range(s, e)})
    assert profile_sp.intersect_len(a, b) == both


def test_analyse_splits_steps_and_separates_nccl_from_compute(tmp_path):
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "gdn_step0", "ts": 0, "dur": 500},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "gdn_step0", "ts": 5, "dur": 500},   # not a step mark
        {"ph": "X", "cat": "user_annotation", "name": "gdn_step1", "ts": 1000, "dur": 500},
        # step 0: NCCL 10-60, compute 40-80 and 90-100 -> overlap 20, exposed 30, idle 10 (80-90)
        kernel("ncclDevKernel_SendRecv", 10, 50), kernel("gemm", 40, 40), kernel("copy", 90, 10),
        # step 1: the same shifted, but the compute is longer (40-120): span 110, idle 0
        kernel("ncclDevKernel_SendRecv", 1010, 50), kernel("gemm", 1040, 80), kernel("copy", 1090, 10),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    med, top = profile_sp.analyse(str(path))
    # medians over the two steps, in ms (trace times are us)
    assert med["span"] == pytest.approx((90 + 110) / 2 / 1e3)
    assert med["nccl"] == pytest.approx(50 / 1e3)
    assert med["compute"] == pytest.approx((50 + 80) / 2 / 1e3)
    assert med["overlapped"] == pytest.approx(20 / 1e3)
    assert med["exposed"] == pytest.approx(30 / 1e3)
    assert med["idle"] == pytest.approx((10 + 0) / 2 / 1e3)
    assert [name for name, _ in top] == ["gemm", "ncclDevKernel_SendRecv", "copy"]
    assert dict(top)["gemm"] == pytest.approx((40 + 80) / 2)


@pytest.mark.parametrize("name, where", [
    ("/opt/venv/lib/python3.12/site-packages/triton/runtime/jit.py(695): run", "triton (Python)"),
    ("/tmp/site/fla/ops/utils/cache.py(374): run", "fla (Python)"),
    ("/opt/venv/lib/python3.12/site-packages/torch/_library/autograd.py(73): backward", "torch/_library (Python)"),
    ("/tmp/pkg/gdn_layer/kernels/ops_conv.py(47): <genexpr>", "gdn_layer (Python)"),
    (str(Path(__file__).resolve().parent.parent / "kernels" / "ops_conv.py") + "(140): op", "gdn_layer (Python)"),
    ("flash_qla/ops/chunk.py(10): chunk_fwd", "flash_qla (Python)"),     # (not fla's: whole path components)
    ("fla/ops/utils/index.py(40): wrapper", "fla (Python)"),
    ("torch/nn/parallel/distributed.py(1600): forward", "other Python"),
    ("kernels/layer.py(3): forward", "other Python"),                   # a site-packages `kernels`, not ours
    ("aten::mm", "aten ops (dispatch, allocation)"),
    ("cudaLaunchKernel", "CUDA runtime calls"),
    ("<built-in method apply of FunctionMeta object at 0x7f>", "builtins called from Python"),
])
def test_host_time_is_attributed_to_the_package_of_each_frame(name, where):
    import bench_host_cost
    assert bench_host_cost._where(name) == where


def test_frames_named_from_a_checkout_on_the_path_are_the_layers(monkeypatch):
    """torch's tracer cuts a ``sys.path`` prefix off: with this checkout on the path (``PYTHONPATH=.``) our
    frames read ``kernels/ops_conv.py(...)``; the checkout's tests and scripts are not the layer's."""
    import bench_host_cost
    root = str(Path(__file__).resolve().parent.parent)
    monkeypatch.syspath_prepend(root)
    assert bench_host_cost._where("kernels/ops_conv.py(140): op") == "gdn_layer (Python)"
    assert bench_host_cost._where("parallel/heads.py(20): k_heads") == "gdn_layer (Python)"
    assert bench_host_cost._where("tests/oracle.py(10): rel_err") == "other Python"
    assert bench_host_cost._where("kernels/layer.py(3): forward") == "other Python"   # no such file of ours


def test_python_profile_profiles_again_when_torch_cannot_decode_a_name(monkeypatch, capsys):
    """torch's profiler now and then raises UnicodeDecodeError from key_averages(): profiled again (up to 3
    times in all), then the error is raised."""
    import bench_host_cost
    failures = {"left": 0}
    real = bench_host_cost.profile

    class Flaky:
        def __init__(self, *a, **k):
            self.prof = real(*a, **k)

        def __enter__(self):
            self.prof.__enter__()
            return self

        def __exit__(self, *exc):
            return self.prof.__exit__(*exc)

        def key_averages(self):
            if failures["left"]:
                failures["left"] -= 1
                raise UnicodeDecodeError("utf-8", b"\x94", 0, 1, "invalid start byte")
            return self.prof.key_averages()

    monkeypatch.setattr(bench_host_cost, "profile", Flaky)
    calls = []
    failures["left"] = 2
    per = bench_host_cost.python_profile(lambda: calls.append(1), 1, 1, sync=lambda: None)
    assert len(calls) == 3 and isinstance(per, dict)            # two failed profiles, the third one read
    failures["left"] = 3
    with pytest.raises(UnicodeDecodeError):
        bench_host_cost.python_profile(lambda: calls.append(1), 1, 1, sync=lambda: None)


def test_the_fla_refusals_name_fla_core(monkeypatch):
    """With a GPU but no fla-core importable, the scripts that compare with fla say so (not an ImportError)."""
    import importlib.util

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real_find_spec(name, *a))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))
    import requires
    with pytest.raises(SystemExit, match="fla-core, which is not importable"):
        requires.require_cuda("x.py", fla=True)
    requires.require_cuda("x.py")                                 # no fla needed: passes
    import bench_vs_fla
    with pytest.raises(SystemExit, match="fla-core, which is not importable"):
        bench_vs_fla.main(["--T", "2048"])


def test_python_profile_attributes_a_layer_call_on_the_cpu(capsys):
    """The shares add up to the whole self time, and the layer's own Python and the aten ops are among them."""
    import torch

    import bench_host_cost
    from gdn_layer import GatedDeltaNet
    layer = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch")
    x = torch.randn(1, 20, 32, requires_grad=True)
    cu = torch.tensor([0, 7, 20])
    per = bench_host_cost.python_profile(lambda: layer(x, cu_seqlens=cu).sum().backward(), 2, 5, sync=lambda: None)
    out = capsys.readouterr().out
    total = float(out.split("(total ")[1].split(" ms")[0])
    assert abs(sum(per.values()) - total) <= 0.01 * total + 0.01
    assert per.get("gdn_layer (Python)", 0) > 0 and per.get("aten ops (dispatch, allocation)", 0) > 0


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [
    ["benchmarks/bench_host_cost.py", "--shapes", "ft", "--T", "2048"],
    ["benchmarks/bench_triton_conv.py", "--quick"],
    ["benchmarks/bench_triton_norm.py"],
    ["benchmarks/profile_layer.py"],
    ["benchmarks/bench_vs_fla.py", "--T", "2048"],
    ["benchmarks/compile_check.py"],
    ["benchmarks/bench_null_backend.py", "--device", "cuda"],
    ["benchmarks/profile_sp.py"],
])
def test_gpu_scripts_refuse_a_machine_without_cuda_by_name(command):
    """Where no CUDA GPU is visible (this CI machine), each GPU measurement says so in one line, instead of
    a traceback from inside torch or an ImportError of fla."""
    import subprocess
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the scripts run there")
    p = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "needs a CUDA GPU (none is visible)" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_gpu_session_refuses_a_machine_without_cuda_by_name():
    """scripts/gpu_session.sh (where the refusals above send the user) says so in one line and exits 1, before
    it unpacks anything, instead of running every step into a missing nvidia-smi / torch (exit 0)."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("a CUDA GPU is visible: the session runs there")
    p = subprocess.run(["bash", "scripts/gpu_session.sh", "vs_fla_auto"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "needs a CUDA GPU (none is visible)" in p.stderr, (p.returncode, p.stderr[-2000:])
    assert p.stdout == "", p.stdout[-2000:]


def _kernel_events(rnd, n):
    ks = []
    for _ in range(n):
        s = rnd.randint(0, 400)
        ks.append({"ph": "X", "cat": "kernel", "name": f"k{s}", "ts": s, "dur": rnd.randint(1, 40)})
    return sorted(ks, key=lambda k: k["ts"])


@pytest.mark.parametrize("seed", range(6))
def test_profile_layer_timeline_and_window_match_a_brute_force_count(seed):
    """profile_layer.py's GPU span / busy / idle gaps (--gaps) and the busy time in a step's window (--loop),
    against counting covered microseconds one by one, on overlapping, nested and separated kernels."""
    import profile_layer
    rnd = random.Random(seed)
    ks = _kernel_events(rnd, 15)
    span, busy, gaps = profile_layer.timeline(ks)
    covered = {t for k in ks for t in range(k["ts"], k["ts"] + k["dur"])}
    assert busy == len(covered)
    assert span == max(k["ts"] + k["dur"] for k in ks) - ks[0]["ts"]
    assert sum(g for g, *_ in gaps) == span - busy
    assert all(g > 0 and after in {k["name"] for k in ks} for g, _, after in gaps)
    a = rnd.randint(0, 200)
    b = a + rnd.randint(1, 250)
    assert profile_layer.busy_in(ks, a, b) == len({t for t in covered if a <= t < b})
    assert profile_layer.timeline([]) == (0.0, 0.0, [])


def test_profile_layer_loop_windows_run_from_clear_to_clear(capsys):
    """--loop: step i's GPU window runs from the end of its L2 clear's kernel to the start of the next clear (the
    last to the last kernel), so kernels launched from autograd's thread count too; the idle time includes the
    wait before the first kernel, and the largest gap is named by its neighbours."""
    import profile_layer
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}   # noqa: E731
    ann = lambda name, ts, dur: {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    ev = [k("clear", 0, 10), ann("bench_clear_0", 0, 10), k("fwd", 30, 20), k("bwd", 55, 40),
          k("clear", 100, 10), ann("bench_clear_1", 100, 10), k("fwd", 110, 20), k("bwd", 130, 30),
          ann("bench_step_0", 30, 20)]   # (a record_function range: not a window, the clears are)
    assert profile_layer.step_windows(ev, 2) == [(10, 100), (110, 160)]
    assert profile_layer.step_windows(ev, 3)[2] is None
    profile_layer.print_loop(ev, [0.1, 0.05], [1.0, 2.0])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    # step 0: window 90 us, busy 20 + 40, idle 30 (20 before fwd, 5 between, 5 to the next clear)
    assert rows[0].split(" | ")[3:6] == ["0.090", "0.060", "0.030"], rows[0]
    assert "20: (L2 clear) -> fwd" in rows[0]
    assert rows[1].split(" | ")[3:6] == ["0.050", "0.050", "0.000"], rows[1]


def test_profile_layer_names_the_op_and_frames_that_launched_a_kernel(capsys):
    """--why: a kernel is attributed, through its launch's correlation id, to the aten ops and the project's
    Python frames around the launch (innermost last), with its time per step."""
    import profile_layer
    ev = [
        {"ph": "X", "cat": "kernel", "name": "Memcpy DtoD", "ts": 100, "dur": 40, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 150, "dur": 40, "args": {"correlation": 8}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 10, "dur": 2, "tid": 1,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 30, "dur": 2, "tid": 1,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "cpu_op", "name": "PowBackward0", "ts": 5, "dur": 20, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 8, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 28, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "/x/gdn_layer/layer.py(9): forward", "ts": 0, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "python_function", "name": "/usr/lib/other.py(1): f", "ts": 1, "dur": 40, "tid": 1},
    ]
    profile_layer.print_why(ev, "Memcpy", steps=2)
    out = capsys.readouterr().out
    assert "20.0  Memcpy DtoD" in out and "ops: PowBackward0 > aten::copy_" in out
    assert "gdn_layer/layer.py(9): forward" in out and "other.py" not in out and "gemm" not in out
