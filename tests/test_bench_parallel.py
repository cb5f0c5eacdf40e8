"""benchmarks/bench_parallel.py on CPU under torchrun (gloo, 2 ranks): the three modes, their agreement with one
process, and the byte counter of ``benchmarks/timing.py``."""
import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_parallel_runs_three_modes_and_counts_the_bytes_each_rank_sends(tmp_path):
    out = tmp_path / "rows.json"
    T, P, hidden, Hk, Hv, D = 512, 2, 64, 2, 4, 16
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={P}",
           os.path.join(ROOT, "benchmarks", "bench_parallel.py"), "--device", "cpu", "--dtype", "float32",
           "--backend", "torch", "--seq-lens", str(T), "--hidden", str(hidden), "--k-heads", str(Hk),
           "--v-heads", str(Hv), "--head-dim", str(D), "--iters", "2", "--warmup", "1", "--check",
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr

    # --check: sp and cp give the single-process output and input gradient (fp32)
    errors = re.findall(r"check T=512: (\w+) vs one: max rel error output (\S+), input grad (\S+)", done.stdout)
    assert [e[0] for e in errors] == ["sp", "cp"], done.stdout
    assert all(float(e) < 1e-5 for _, *errs in errors for e in errs), errors

    for mode in ("one", "sp", "cp"):
        assert re.search(rf"^\| {mode} \| {T} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+x \|", done.stdout, re.M), done.stdout
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["cp", "one", "sp"]
    for r in rows.values():
        assert r["T"] == T and not r.get("oom")
        assert math.isfinite(r["fwd_ms"]) and r["fwd_ms"] > 0
        assert math.isfinite(r["fwd_bwd_ms"]) and r["fwd_bwd_ms"] > 0

    assert rows["one"]["sent_bytes"] == 0 and rows["one"]["collectives"] == {}
    # sp: seq_to_head sends T/P tokens of [q | k | v | a | b], head_to_seq all T tokens of this rank's
    # Hv/P value heads (fp32), each less the block a rank keeps for itself ((P - 1) / P of it, to the
    # peers in one point-to-point batch); on CPU one small all-reduce checks that the ranks' inputs agree
    conv_dim = 2 * Hk * D + Hv * D
    payload = (T // P * (conv_dim + 2 * Hv) + T * Hv // P * D) * 4 * (P - 1) // P
    assert payload <= rows["sp"]["sent_bytes"] < payload + 1024, rows["sp"]
    assert rows["sp"]["collectives"]["batch_isend_irecv"] == 2
    assert "all_to_all_single" not in rows["sp"]["collectives"]
    # cp: the conv halo (W-1 = 3 tokens of every channel) and one [Hv, Dk, Dk + Dv] fp32 map per rank
    payload = (3 * conv_dim + Hv * D * 2 * D) * 4
    assert payload <= rows["cp"]["sent_bytes"] < payload + 1024, rows["cp"]
