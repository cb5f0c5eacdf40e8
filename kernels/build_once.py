"""One cold build per machine: the first process that warms a layer configuration builds its kernels, the
others of the same machine wait for it and then load what it built.

Under torchrun every local rank calls ``warmup(layer)`` at about the same time with the same configuration,
and every rank would compile the same kernels into the same disk cache at once (8 ranks: 8 times the CPU
work, each rank's build slowed by the others). ``first_on_machine(key)`` serialises the first build through
a lock file beside Triton's cache (``flock``: the operating system releases it when its holder exits, so a
rank that crashes while building never leaves the others waiting); the builder leaves a marker for ``key``
when it finishes, and a process that finds the marker goes on at once (its calls then load the kernels). No
collective is involved: a rank that calls ``warmup`` alone never waits for the others.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os

try:
    import fcntl
except ImportError:          # (not on Windows: no lock, every process builds)
    fcntl = None


def cache_dir() -> str:
    """Triton's cache directory (``TRITON_CACHE_DIR`` or Triton's default), where the lock and markers live."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    try:
        from triton import knobs
        return knobs.cache.dir
    except (ImportError, AttributeError):
        return os.path.join(os.path.expanduser("~"), ".triton", "cache")


def key_of(*parts) -> str:
    """A short stable key for JSON-able ``parts`` (the configuration, the software versions)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@contextlib.contextmanager
def first_on_machine(key: str, directory: str | None = None):
    """Run the body as the machine's one builder of ``key``, or after it has finished.

    Yields True when this process builds (no marker yet: it holds the lock for the body, and leaves the
    marker if the body returns), False when another process built ``key`` before (the body runs at once,
    concurrently with other such processes). A body that raises leaves no marker: the next waiter builds.
    Where no lock can be taken (no ``fcntl``, an unwritable directory), every process builds.
    """
    directory = directory or cache_dir()
    marker = os.path.join(directory, f"gdn_layer_built_{key}")
    try:
        os.makedirs(directory, exist_ok=True)
        lock = open(os.path.join(directory, "gdn_layer_build.lock"), "a+")
    except OSError:
        lock = None
    if lock is None or fcntl is None:
        yield True
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(marker):
            fcntl.flock(lock, fcntl.LOCK_UN)
            yield False
            return
        try:
            yield True
            with open(marker, "w"):
                pass
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


__all__ = ["first_on_machine", "key_of", "cache_dir"]
