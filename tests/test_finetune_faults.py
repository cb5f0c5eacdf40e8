"""examples/finetune.py under faults: a rank SIGKILLed mid-run, the writer SIGKILLed mid-save, a resume
with another SP/DP layout, and a checkpoint that would run code when unpickled.

The kill tests launch the tiny job with torchrun (2 ranks, gloo, CPU) as a user would, and require the
crashed-then-resumed run to leave exactly what an uninterrupted run leaves: the same final weights and
optimizer state (bitwise), the same loss history, and the same log.jsonl (one line per step, none
twice; the tokens/s field is a timing and is left out of the comparison).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import checkpoint  # noqa: E402
from test_finetune_smoke import argv, finetune, write_corpus  # noqa: E402
STEPS, SAVE_EVERY, KILL_STEP = 8, 3, 6     # checkpoints at 3 and 6; the kill comes before the second one


def torchrun(args, timeout=180) -> subprocess.CompletedProcess:
    """The tiny job on 2 ranks, launched like a user would; a hang fails the test through ``timeout``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", "finetune.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=timeout)


def job(corpus, out, *extra):
    return argv(corpus, str(out), 2, "--save-every", str(SAVE_EVERY), *extra, steps=STEPS)


def log_steps(out) -> list[dict]:
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def load(out) -> dict:
    return torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "synthetic")


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    done = torchrun(job(corpus, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_run_killed_twice_and_resumed_equals_the_uninterrupted_run(corpus, uninterrupted, tmp_path):
    # 1. Rank 1 dies on entering step 6. That proves rank 0 finished step 5's collectives, hence logged
    #    steps 1..4 (almost surely 5 too) past the step-3 checkpoint: the resumed run must drop them.
    crashed = torchrun(job(corpus, tmp_path, "--kill-at", f"1:{KILL_STEP}"))
    assert crashed.returncode != 0, "the injected SIGKILL did not stop the job"
    assert load(tmp_path)["step"] == SAVE_EVERY
    assert [r["step"] for r in log_steps(tmp_path)][:KILL_STEP - 2] == list(range(1, KILL_STEP - 1))

    # 2. Resumed, then rank 0 (the writer) dies while saving step 6: the new checkpoint exists only as
    #    the temp file, the step-3 one is whole, the log holds steps 1..6 (once each).
    crashed = torchrun(job(corpus, tmp_path, "--resume", "--kill-at", f"save:{KILL_STEP}"))
    assert crashed.returncode != 0, "the injected SIGKILL did not stop the job"
    assert f"resumed from step {SAVE_EVERY}" in crashed.stdout
    assert load(tmp_path)["step"] == SAVE_EVERY
    assert os.path.isfile(tmp_path / "checkpoint.pt.tmp")
    assert [r["step"] for r in log_steps(tmp_path)] == list(range(1, KILL_STEP + 1))

    # 3. Resumed again, to the end.
    resumed = torchrun(job(corpus, tmp_path, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {SAVE_EVERY}" in resumed.stdout

    want, got = load(uninterrupted), load(tmp_path)
    assert got["step"] == want["step"] == STEPS
    assert got["history"] == want["history"] and len(got["history"]) == STEPS
    assert got["model"].keys() == want["model"].keys()
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), k
    for p, state in want["optimizer"]["state"].items():
        for k in state:
            assert torch.equal(got["optimizer"]["state"][p][k], state[k]), (p, k)
    timing = lambda rows: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]
    assert timing(log_steps(tmp_path)) == timing(log_steps(uninterrupted))
    assert [r["step"] for r in log_steps(tmp_path)] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in log_steps(tmp_path)] == want["history"]
    with open(tmp_path / "metrics.json") as f, open(uninterrupted / "metrics.json") as g:
        assert json.load(f)["eval_after"] == json.load(g)["eval_after"]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


class RunsCode:
    """Unpickling this calls ``open(marker, "w")``: stands for any payload a hostile checkpoint can carry."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_resume_refuses_a_checkpoint_holding_other_objects_and_runs_none_of_it(corpus, tmp_path):
    finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, steps=1)))
    path, marker = tmp_path / "checkpoint.pt", tmp_path / "payload-ran"
    state = torch.load(path, weights_only=True)
    state["history"] = [RunsCode(marker)]
    torch.save(state, path)

    with pytest.raises(ValueError) as err:
        finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, "--resume", steps=2)))
    msg = str(err.value)
    assert str(path) in msg and "objects other than tensors, containers, numbers and strings" in msg
    assert "refused for safety" in msg
    assert not marker.exists()
    torch.load(path, weights_only=False)   # what the refusal prevented: loading it the old way runs it
    assert marker.exists()


def test_resume_with_another_sp_size_continues_the_same_run(corpus, uninterrupted, tmp_path):
    """Parameters are whole on every rank and SP only splits the math: the sp=2 run's last checkpoint,
    trained on at sp=1, gives the losses of an sp=1 run from the start (within float rounding: SP sums
    in another order)."""
    more = STEPS + 2
    single = finetune.run(finetune.parse_args(argv(corpus, str(tmp_path / "single"), 1, steps=more)))
    resumed = finetune.run(finetune.parse_args(argv(corpus, str(tmp_path / "switch"), 1, "--resume",
                                                    str(uninterrupted / "checkpoint.pt"), steps=more)))
    assert resumed["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=0)
    assert resumed["eval_after"] == pytest.approx(single["eval_after"], rel=1e-5)
    assert [r["step"] for r in log_steps(tmp_path / "switch")] == [STEPS + 1, more]  # another --out: no old lines


def test_resume_with_another_dp_size_is_refused(corpus, tmp_path):
    """DP size = sequences per step, and it picks each step's sequences: resuming at another DP size
    would re-train on sequences already taken (measured: the losses then match neither run). The
    checkpoint is marked as made at dp=2 rather than made by 2 processes: the check is what is tested."""
    finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, steps=2)))
    path = tmp_path / "checkpoint.pt"
    torch.save({**torch.load(path, weights_only=True), "dp": 2}, path)
    with pytest.raises(ValueError, match=r"DP size 2 .*this run has 1 .*cannot change on resume"):
        finetune.run(finetune.parse_args(argv(corpus, str(tmp_path), 1, "--resume", steps=4)))


def test_save_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    """Without the directory fsync a power cut after the rename can lose the rename itself."""
    path, synced = tmp_path / "checkpoint.pt", []
    real_fsync = os.fsync

    def spy(fd):
        synced.append((os.fstat(fd).st_ino, path.exists()))
        real_fsync(fd)
    monkeypatch.setattr(checkpoint.os, "fsync", spy)
    checkpoint.save_checkpoint(str(path), {"w": torch.randn(3)})
    assert synced[0][1] is False                       # the data reached the disk before the rename
    assert synced[-1] == (os.stat(tmp_path).st_ino, True)  # the directory after it
    assert not (tmp_path / "checkpoint.pt.tmp").exists()


def test_truncate_log_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "log.jsonl"
    lines = [json.dumps({"step": s, "loss": float(torch.rand(()))}) + "\n" for s in range(1, 6)]
    path.write_text("".join(lines) + '{"step": 6, "lo')          # the crash tore line 6
    assert checkpoint.truncate_log(str(path), 3) == [1, 2, 3]
    assert path.read_text() == "".join(lines[:3])
    path.write_text("".join(lines) + '{"step": 6, "lo')
    assert checkpoint.truncate_log(str(path), 7) == [1, 2, 3, 4, 5]
    assert path.read_text() == "".join(lines)
    assert checkpoint.truncate_log(str(tmp_path / "absent.jsonl"), 4) == []
