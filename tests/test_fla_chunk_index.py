"""fla's chunk index built on the device at the pack's capacity (``fla_backend.chunk_index``): the rows of
fla's exact index first, then padding rows that fla's GDN chunk kernels turn into no-ops. What lets the
``fla`` backend run without reading ``cu_seqlens`` on the host, and a CUDA graph captured on one packing
replay another of the same capacity (docs/performance.md, "CUDA graphs")."""
import json
import math
import os
import random
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from gdn_layer.kernels import fla_backend
from gdn_layer.kernels.fla_backend import CHUNK, chunk_index

HERE = Path(__file__).resolve().parent
FLA_SITE = HERE.parent / ".venv" / "fla-site"


def expected(lengths):
    """The index written out from the lengths, independently of the code under test."""
    rows = [[i, c] for i, n in enumerate(lengths) for c in range(math.ceil(n / CHUNK))]
    return rows, (sum(lengths) + (CHUNK - 1) * len(lengths)) // CHUNK if sum(lengths) else 0


PACKS = [[200], [64], [1], [63, 1], [0, 5, 65, 60, 70, 0, 0], [0, 0, 300], [1] * 40, [64] * 5, [129, 0, 2, 0],
         [0, 0, 0]]


@pytest.mark.parametrize("lengths", PACKS + [[random.Random(s).randint(0, 150) for _ in range(s)] for s in (3, 9, 27)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_real_rows_then_padding_rows_past_the_last_sequence(lengths, dtype):
    cu = torch.tensor([0] + lengths).cumsum(0).to(dtype)
    got = chunk_index(cu, sum(lengths))
    rows, cap = expected(lengths)
    assert got.dtype == torch.int64 and tuple(got.shape) == (cap, 2)
    assert got[:len(rows)].tolist() == rows
    last = len(lengths) - 1
    for seq, c in got[len(rows):].tolist():           # padding: the last sequence, a chunk past its end
        assert seq == last and c * CHUNK >= lengths[last]


def test_capacity_depends_on_the_shapes_only():
    """Any packing of T tokens into N segments gives the same number of rows (one grid for a CUDA graph)."""
    T, N = 1000, 7
    sizes = set()
    for seed in range(20):
        rnd = random.Random(seed)
        cuts = sorted(rnd.randint(0, T) for _ in range(N - 1))
        cu = torch.tensor([0, *cuts, T])
        got = chunk_index(cu, T)
        assert got[:, 1].min() >= 0
        sizes.add(len(got))
        assert len(expected((cu[1:] - cu[:-1]).tolist())[0]) <= len(got)
    assert sizes == {(T + (CHUNK - 1) * N) // CHUNK}


def test_reads_nothing_on_the_host():
    from host_read_spy import HostReadSpy
    cu = torch.tensor([0, 5, 70, 130, 200, 200])
    with HostReadSpy() as spy:
        chunk_index(cu, 200)
    assert spy.found == []


@pytest.mark.slow
@pytest.mark.parametrize("lengths", [[0, 5, 65, 60, 70, 0, 0], [130, 1, 0, 64, 2]])
def test_fla_chunk_kernels_give_the_same_outputs_with_the_padded_index(lengths):
    """fla's chunk-grid kernels (forward and backward) under Triton's interpreter: outputs with the
    capacity index equal (bitwise) those with fla's own exact index, although the padding programs see
    NaN chunk states."""
    if not (FLA_SITE / "fla").is_dir():
        pytest.fail(f"fla-core is not installed in {FLA_SITE}: run scripts/setup.sh")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(FLA_SITE), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, str(HERE / "fla_index_probe.py"), *map(str, lengths)], capture_output=True,
                       text=True, timeout=600, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["capacity_rows"] > r["exact_rows"] and len(r["outputs"]) == 15
    assert r["differ"] == []


def test_the_ascend_backend_keeps_flas_exact_index():
    """fla's triton_ascend chunk kernels find each task's sequence from the chunk offsets: a padding row of
    the capacity index would send them past cu_seqlens. The ascend backend hands fla's exact index instead
    (one host read per cu tensor; no CUDA graphs there)."""
    from gdn_layer.kernels import ascend_backend, fla_backend
    be = ascend_backend.make_backend()
    for op in (be.chunk_gated_delta_rule, be.chunk_gated_delta_rule_bwd):
        assert op.keywords["index"] is fla_backend.exact_chunk_index
    cuda = fla_backend.make_backend()
    assert cuda.chunk_gated_delta_rule is fla_backend.chunk_fwd and cuda.chunk_gated_delta_rule_bwd is fla_backend.chunk_bwd



# ---------------------------------------------------------------------- fla's tensor_cache in a capture
@pytest.mark.parametrize("capturing", [True, False])
def test_fla_tensor_cache_is_off_inside_a_capture_only(capturing):
    """Inside a capture fla's identity-keyed ``tensor_cache`` would keep its lengths and chunk offsets of
    cu_seqlens in the graph's pool (reduce-overhead's graph trees then refuse the graph): the fla backend
    switches it off for each call made while capturing, and leaves it as it was otherwise
    (``fla_cache_probe.py``: fla's chunk functions stubbed, each records the switch when called)."""
    if not (FLA_SITE / "fla").is_dir():
        pytest.fail(f"fla-core is not installed in {FLA_SITE}: run scripts/setup.sh")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(FLA_SITE), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, str(HERE / "fla_cache_probe.py"), str(int(capturing))], capture_output=True,
                       text=True, timeout=300, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-2000:] + p.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["seen"] == [capturing] * 4          # chunk forward: 1 call; backward: 3
    assert result["after"] is False                    # put back after each call
    assert result["fla_reads_the_switch"]              # (an fla upgrade that stops reading it would show here)


@pytest.fixture
def fake_fla(monkeypatch):
    """``fla.utils`` with only the switch, and every call counted as made during a capture."""
    fla, utils = types.ModuleType("fla"), types.ModuleType("fla.utils")
    fla.utils = utils
    utils.FLA_DISABLE_TENSOR_CACHE = False
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "fla.utils", utils)
    monkeypatch.setattr(fla_backend.cu_cache, "capturing", lambda t: True)
    return utils


def test_an_exception_inside_a_capture_call_puts_the_switch_back(fake_fla):
    with pytest.raises(RuntimeError, match="kernel failed"):
        with fla_backend._fla_cache_off_in_capture(torch.zeros(1)):
            assert fake_fla.FLA_DISABLE_TENSOR_CACHE is True
            raise RuntimeError("kernel failed")
    assert fake_fla.FLA_DISABLE_TENSOR_CACHE is False


def test_a_user_set_switch_is_left_as_it_was(fake_fla):
    fake_fla.FLA_DISABLE_TENSOR_CACHE = True          # FLA_DISABLE_TENSOR_CACHE=1 in the environment
    with fla_backend._fla_cache_off_in_capture(torch.zeros(1)):
        pass
    assert fake_fla.FLA_DISABLE_TENSOR_CACHE is True


def test_the_policy_wrapper_takes_tensors_given_as_keywords():
    """An all-keyword call: a bare next() over the positional arguments raised StopIteration, which map()
    or a generator silently reads as 'no more items' (0 results for 2 calls, no error)."""
    seen = []
    wrapped = fla_backend._fla_cache_policy(lambda q, k: seen.append(q.shape) or q)
    q = torch.zeros(2)
    out = list(map(lambda kw: wrapped(**kw), [dict(q=q, k=q)] * 2))
    assert len(out) == 2 and len(seen) == 2


def test_two_overlapping_captures_on_two_threads_keep_the_cache_off_until_both_end(fake_fla):
    """Thread A enters, thread B enters, A leaves while B still captures: B's fla calls must still see the
    cache off, and the switch must be back to False after both (it was set True for good)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with fla_backend._fla_cache_off_in_capture(torch.zeros(1)):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with fla_backend._fla_cache_off_in_capture(torch.zeros(1)):
            b_in.set()
            a_out.wait(10)
            seen["B after A left"] = fake_fla.FLA_DISABLE_TENSOR_CACHE

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    seen["after both"] = fake_fla.FLA_DISABLE_TENSOR_CACHE
    assert seen == {"B after A left": True, "after both": False}


def test_a_capture_call_switches_the_cache_off_again_if_it_was_switched_back_meanwhile(fake_fla):
    with fla_backend._fla_cache_off_in_capture(torch.zeros(1)):
        fake_fla.FLA_DISABLE_TENSOR_CACHE = False                  # someone else, while a capture is open
        with fla_backend._fla_cache_off_in_capture(torch.zeros(1)):
            assert fake_fla.FLA_DISABLE_TENSOR_CACHE is True
    assert fake_fla.FLA_DISABLE_TENSOR_CACHE is False
