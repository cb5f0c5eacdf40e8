"""kernels/build_once.py: the first process of a machine to warm a configuration builds it, the others wait
for it and then go on without building; a builder that fails or dies leaves the next one to build."""
import multiprocessing as mp
import os
import time

import pytest

from gdn_layer.kernels import build_once

pytestmark = pytest.mark.skipif(build_once.fcntl is None, reason="no fcntl: every process builds by design")


def _warm(directory, key, log, fail=False, entered=None):
    """A process's warmup: records (pid, built?, start, end) in ``log``; sets ``entered`` inside the build."""
    with build_once.first_on_machine(key, directory) as building:
        start = time.monotonic()
        if entered is not None:
            entered.set()
        if building:
            time.sleep(0.6)                       # a cold build
            if fail:
                os._exit(3)                       # dies while holding the lock
        log.put((os.getpid(), building, start, time.monotonic()))


def _run(directory, key, n, fail_first=False):
    ctx = mp.get_context("fork")       # (the child runs no torch code)
    log, entered = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_warm, args=(directory, key, log, fail_first and i == 0, entered if i == 0 else None))
             for i in range(n)]
    procs[0].start()
    assert entered.wait(60)          # the first holds the lock (or found the marker) before the others start
    for p in procs[1:]:
        p.start()
    for p in procs:
        p.join(60)
    return sorted((log.get(timeout=10) for _ in range(n - (1 if fail_first else 0))), key=lambda r: r[2])


def test_one_process_builds_and_the_others_start_after_it(tmp_path):
    rows = _run(str(tmp_path), "cfg", 4)
    assert [r[1] for r in rows] == [True, False, False, False]
    builder_end = rows[0][3]
    assert all(r[2] >= builder_end for r in rows[1:])
    # a later process of the same configuration does not build either; another configuration does
    assert [r[1] for r in _run(str(tmp_path), "cfg", 2)] == [False, False]
    assert [r[1] for r in _run(str(tmp_path), "other", 2)] == [True, False]


def test_a_builder_that_dies_leaves_the_build_to_the_next(tmp_path):
    rows = _run(str(tmp_path), "cfg", 3, fail_first=True)
    assert [r[1] for r in rows] == [True, False]


def test_an_unwritable_directory_builds_in_every_process(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    with build_once.first_on_machine("cfg", str(target / "cache")) as building:
        assert building is True


def test_keys_name_the_configuration():
    assert build_once.key_of(1, "a") == build_once.key_of(1, "a") != build_once.key_of(2, "a")


def test_a_file_system_without_flock_builds_in_every_process(tmp_path, monkeypatch):
    def no_flock(f, op):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(build_once.fcntl, "flock", no_flock)
    with build_once.first_on_machine("cfg", str(tmp_path)) as building:
        assert building is True


def test_a_nested_build_in_one_thread_does_not_wait_on_itself(tmp_path):
    with build_once.first_on_machine("outer", str(tmp_path)) as outer:
        with build_once.first_on_machine("inner", str(tmp_path)) as inner:
            assert outer is True and inner is True


def test_a_builder_that_outlasts_the_wait_limit_is_not_waited_for(tmp_path, monkeypatch):
    ctx = mp.get_context("fork")
    started = ctx.Event()

    def hold():
        with build_once.first_on_machine("slow", str(tmp_path)):
            started.set()
            time.sleep(30)
    p = ctx.Process(target=hold)
    p.start()
    try:
        assert started.wait(10)
        monkeypatch.setattr(build_once, "WAIT_LIMIT_S", 0.5)
        t0 = time.monotonic()
        with build_once.first_on_machine("slow", str(tmp_path)) as building:
            assert building is True and time.monotonic() - t0 < 5
    finally:
        p.kill()
        p.join()


def _fully_sharded_runs_collectives(store_path, out):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from gdn_layer import GatedDeltaNet
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    try:
        out.put(build_once.runs_collectives(fully_shard(GatedDeltaNet(32, 2, 4, 8, 8))))
    finally:
        dist.destroy_process_group()


def test_layers_whose_forward_runs_collectives_are_recognised(tmp_path):
    import torch

    from gdn_layer import GatedDeltaNet
    layer = GatedDeltaNet(32, 2, 4, 8, 8)
    assert not build_once.runs_collectives(layer)

    class FullyShardedDataParallel(torch.nn.Module):     # (what an FSDP1 wrapper is called)
        pass
    assert build_once.runs_collectives(torch.nn.Sequential(layer, FullyShardedDataParallel()))
    ctx = mp.get_context("fork")                         # (a process group of its own)
    out = ctx.Queue()
    p = ctx.Process(target=_fully_sharded_runs_collectives, args=(str(tmp_path / "store"), out))
    p.start()
    p.join(120)
    assert out.get(timeout=5) is True                    # FSDP2: DTensor parameters


def test_the_key_names_the_software():
    versions = build_once.software()
    assert versions["torch"] and len(versions["gdn_layer.kernels"]) == 16
