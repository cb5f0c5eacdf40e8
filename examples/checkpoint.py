"""What the fine-tuning example writes to disk, written so that a crash at any instant leaves it whole.

Every file is replaced atomically (``write_atomically``: temp file in the same directory, fsync, rename,
fsync of the directory), so a reader sees either the old content or the new, never a mix, and the rename
itself survives a power cut. Checkpoints are loaded with ``torch.load(weights_only=True)``: tensors,
containers, numbers and strings only, so a checkpoint from elsewhere cannot run code when loaded.
"""
from __future__ import annotations

import json
import os
import pickle
import re

import torch

_TORCH_REASON = re.compile(r"WeightsUnpickler error: (.*?)(?: was not an allowed global|\. |$)", re.MULTILINE)


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` so that a rename inside it is on disk (POSIX; no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:               # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, write, binary: bool = True, before_rename=None) -> None:
    """Call ``write(f)`` on ``PATH.tmp``, fsync it, ``os.replace`` it onto ``path``, fsync the directory.

    A crash before the rename leaves ``path`` as it was (and a stale ``PATH.tmp``, which the next write
    overwrites: one writer per file, rank 0). ``before_rename()`` runs after the fsync, before the
    rename; only the fault-injection test uses it.
    """
    tmp = f"{path}.tmp"
    with open(tmp, "wb" if binary else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def save_checkpoint(path: str, state: dict, before_rename=None) -> None:
    """``torch.save(state)`` to ``path`` through ``write_atomically``: a crash leaves the old checkpoint whole."""
    write_atomically(path, lambda f: torch.save(state, f), before_rename=before_rename)


def load_checkpoint(path: str, device) -> dict:
    """``torch.load(path, weights_only=True)`` onto ``device``.

    Raises:
        ValueError: no file at ``path``; or the file holds objects other than tensors, containers,
            numbers and strings (unpickling those can run arbitrary code, so it is refused and nothing
            of the file is executed).
    """
    if not os.path.isfile(path):
        raise ValueError(f"--resume: no checkpoint at {path}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _TORCH_REASON.search(str(e))
        raise ValueError(
            f"--resume: {path} holds objects other than tensors, containers, numbers and strings"
            f"{' (' + found.group(1) + ')' if found else ''}; refused for safety: loading them could run "
            "arbitrary code. A checkpoint written by examples/finetune.py never holds such objects.") from None


def truncate_log(path: str, step: int) -> list[int]:
    """Cut the JSON-lines step log ``path`` back to its lines of steps ``1..step``, atomically.

    A run killed after its last checkpoint logged steps the resumed run will redo; dropping them makes
    the log equal to an uninterrupted run's. Lines are kept up to the first one past ``step`` or the first
    that does not parse (a line torn by the crash). A missing file counts as empty.

    Returns:
        The steps kept (``[1, ..., step]`` unless the log was deleted or belongs to another ``--out``).
    """
    kept, steps = [], []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    s = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    break
                if not line.endswith("\n") or s > step:
                    break
                kept.append(line)
                steps.append(s)
    write_atomically(path, lambda f: f.writelines(kept), binary=False)
    return steps
