"""The ``ascend`` backend on triton-ascend, without an NPU: every kernel lowers, none recompiles for a
new packed layout, and no launch has more programs than an NPU takes.

``tests/ascend_probe.py`` runs in a subprocess with ``.venv-ascend``'s Python (triton-ascend replaces the
``triton`` package, so it has its own environment; ``scripts/setup.sh`` makes it). The probe uses
triton-ascend's own JIT and its ttir -> ``ttadapter`` lowering with a stand-in NPU driver
(``fake_npu_driver.py``); only the CANN compiler stage (``npubin``) is stubbed. fla-core sees an NPU and
dispatches to its ``triton_ascend`` kernels. What this cannot show (the npubin stage: unified-buffer
size, ops the NPU compiler rejects) is in docs/kernels.md, with how to run ``tests/test_npu.py`` on an NPU.

Each check can fail: ``--negative-control`` runs a kernel whose T is a ``tl.constexpr`` (one compile
per T) at a length whose grid is 65 536 programs, and the second test asserts that the probe sees both.
"""
import json
import os
import pathlib
import subprocess

import pytest

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parent
ASCEND_PYTHON = ROOT / ".venv-ascend" / "bin" / "python"
FLA_SITE = ROOT / ".venv" / "fla-site"          # fla-core 0.6.0, kept out of the venvs' site-packages
GRID_LIMIT = 65535
# fla-core 0.6.0's inner dispatch on an NPU (fla.backends): operation.function -> its triton_ascend kernels
FLA_ASCEND_ROUTINGS = {
    "common.chunk_scaled_dot_kkt_fwd", "fla.ops.utils.solve_tril.solve_tril",
    "gated_delta_rule.chunk_gated_delta_rule_fwd_intra", "gated_delta_rule.recompute_w_u_fwd",
    "common.chunk_gated_delta_rule_fwd_h", "common.chunk_fwd_o", "fla.ops.utils.cumsum.chunk_local_cumsum",
    "common.chunk_bwd_dv_local", "common.chunk_gated_delta_rule_bwd_dhu", "common.chunk_bwd_dqkwg",
    "gated_delta_rule.prepare_wy_repr_bwd",
}
OUR_KERNELS = {"_conv_fwd_kernel", "_conv_state_fwd_kernel", "_conv_dz_kernel", "_conv_dx_kernel",
               "_conv_state_bwd_kernel", "_gate_fwd_kernel", "_gate_bwd_kernel", "_l2norm_fwd_kernel",
               "_l2norm_bwd_kernel", "_norm_fwd_kernel", "_norm_bwd_kernel"}
DECODE_KERNEL = "fused_recurrent_gated_delta_rule_fwd_kernel"
# T up to 2^20 tokens, N up to 2^16 sequences (the grid check allocates nothing: meta tensors); 16 353
# tokens in 512 sequences stopped the conv and conv-state kernels before they were persistent
GRID_SIZES = [(1 << 20, 1), (1 << 20, 1 << 16), (1 << 16, 1 << 16), (16353, 512)]


def probe(*args, timeout=300, check=True):
    for need, what in ((ASCEND_PYTHON, "the triton-ascend environment"), (FLA_SITE / "fla", "fla-core")):
        if not need.exists():
            pytest.fail(f"{what} is missing ({need}): run scripts/setup.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_ALL_BLOCKS_PARALLEL")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FLA_SITE), env.get("PYTHONPATH")]))
    p = subprocess.run([str(ASCEND_PYTHON), str(HERE / "ascend_probe.py"), *args], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=ROOT)
    if not check:
        return p
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    print(f"triton-ascend {r['triton_ascend']}; triton-adapter-opt crashes retried: {r['adapter_crashes']}")
    # triton-adapter-opt's known use-after-free is in fla's decode kernel only (fake_npu_driver): a crash
    # lowering one of ours is new, even when a retry got through
    assert {c["kernel"] for c in r["adapter_crashes"]} <= {DECODE_KERNEL}, r["adapter_crashes"]
    return r


def test_the_split_conv_lowers_for_the_npu():
    """The split conv's kernels (q, k, v written and read as three parts, ``PARTS == 3``) lower: a select
    of pointers per column, the obvious form, crashes triton-adapter-opt every time. (The ``ascend``
    backend still runs one conv per part: the split is not timed on an NPU.)"""
    r = probe("--layouts", "1", "--split-conv")
    new = r["layouts"][0]["new"]
    # the whole conv's variants (with states, and the layer's plain one without) and the split one
    for kernel, variants in (("_conv_fwd_kernel", 3), ("_conv_dz_kernel", 3), ("_conv_state_bwd_kernel", 2)):
        assert new.count(kernel) == variants, (kernel, new)
    # (no crash lowering them: ``probe`` allows triton-adapter-opt's known, random crash in fla's decode kernel
    # only, which this probe lowers too, and asserted `== []` here it failed now and then)


def grid_args(sizes):
    return [a for T, N in sizes for a in ("--grid-check", str(T), str(N))]


def test_ascend_backend_lowers_compiles_once_and_fits_the_npu_grid():
    r = probe(*grid_args(GRID_SIZES))
    assert r["fla_is_npu"], "fla-core did not take the stand-in driver for an NPU"
    # every kernel lowered to ttadapter, the CANN-only npubin stage stubbed
    assert r["first"] > 0 and set(r["kernels"]) == set(r["lowered"]), r["lowered"]
    assert set(r["lowered"].values()) <= {"aiv", "mix"}
    assert OUR_KERNELS | {DECODE_KERNEL} <= set(r["kernels"])
    assert r["conv_splits"] is False     # one conv per part (the split is not timed on an NPU)
    assert set(r["routings"]) == {f"{x} -> triton_ascend" for x in FLA_ASCEND_ROUTINGS}, r["routings"]
    # only the launch option triton-ascend 3.2.0 lacks is dropped (fla passes it for >= 3.6)
    assert set(r["dropped_options"]) <= {"enable_ubuf_saving"}
    # no packed length or sequence count reaches a compile key
    assert len(r["layouts"]) >= 8 and any(x["empty_segment"] for x in r["layouts"])
    assert len({x["T"] for x in r["layouts"]}) >= 8 and len({x["N"] for x in r["layouts"]}) >= 6
    assert r["after_first"] == 0, [x for x in r["layouts"] if x["compiles"]]
    # launch limit
    for g in r["grids"]:
        assert g["error"] is None, g
        assert set(g["programs"]) == set(r["kernels"]), g     # every kernel, fla's chunk kernels too
        over = {k: n for k, n in g["programs"].items() if n > GRID_LIMIT}
        assert not over, f"T={g['T']} N={g['N']}: launches over {GRID_LIMIT} programs: {over}"


def test_the_probe_sees_a_length_in_a_compile_key_and_a_grid_over_the_limit():
    r = probe("--negative-control", "--layouts", "3", *grid_args([(65536 * 128, 1)]))
    assert r["first"] == 1 and r["after_first"] == 2
    assert max(r["grids"][0]["programs"].values()) == 65536 > GRID_LIMIT


def test_a_lowering_killed_by_a_signal_is_retried_then_reported():
    # triton-adapter-opt killed by SIGSEGV on every lowering of fla's decode kernel (a script in front
    # of it): the probe must try it ADAPTER_ATTEMPTS times, say so, and then fail
    import sys
    sys.path.insert(0, str(HERE))
    from fake_npu_driver import ADAPTER_ATTEMPTS
    p = probe("--layouts", "1", "--kill-adapter-on", DECODE_KERNEL, check=False)
    tries = [line for line in p.stderr.splitlines() if " died by signal " in line]
    assert p.returncode != 0 and not any(line.startswith("RESULT ") for line in p.stdout.splitlines())
    assert len(tries) == ADAPTER_ATTEMPTS, p.stderr[-4000:]
    assert all(f"lowering {DECODE_KERNEL} " in line for line in tries), tries


def test_retry_on_signal_retries_only_a_process_killed_by_a_signal():
    import sys
    sys.path.insert(0, str(HERE))
    from fake_npu_driver import retry_on_signal

    def failing(returncodes):
        def lower():
            rc = returncodes.pop(0)
            if rc is None:
                return "lowered"
            raise subprocess.CalledProcessError(rc, ["triton-adapter-opt"])
        return lower

    crashes = []
    assert retry_on_signal(failing([-6, -11, None]), lambda: "k", crashes) == "lowered"
    assert crashes == [{"kernel": "k", "signal": 6}, {"kernel": "k", "signal": 11}]
    crashes = []
    with pytest.raises(subprocess.CalledProcessError):          # the tool's own error: not run again
        retry_on_signal(failing([1, None]), lambda: "k", crashes)
    assert crashes == []
    with pytest.raises(subprocess.CalledProcessError):          # crashes every time: gives up
        retry_on_signal(failing([-6] * 3 + [None]), lambda: "k", crashes, attempts=3)
    assert len(crashes) == 3
