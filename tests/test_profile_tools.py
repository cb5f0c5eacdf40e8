"""The GPU profiling scripts' timeline arithmetic (scripts/profile_sp.py, scripts/profile_finetune.py) on
hand-made traces: the numbers they report in docs/performance.md come from these functions."""
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

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
