"""One cold build per machine: the first process that warms a layer configuration builds its kernels, the
others of the same machine wait for it and then load what it built.

Under torchrun every local rank calls ``warmup(layer)`` at about the same time with the same configuration,
and every rank would compile the same kernels into the same disk cache at once (8 ranks: 8 times the CPU
work, each rank's build slowed by the others). ``first_on_machine(key)`` serialises the first build through
a lock file beside Triton's cache (``flock``: the operating system releases it when its holder exits, so a
rank that crashes while building never leaves the others waiting); the builder leaves a marker for ``key``
when it finishes, and a process that finds the marker goes on at once (its calls then load the kernels). No
collective is involved: a rank that calls ``warmup`` alone never waits for the others. The caller must not
run collectives inside (the lock holder would wait for ranks that wait for the lock).

Where no lock can be taken (no ``fcntl``, an unwritable directory, a file system without ``flock``), inside
a build this thread already holds, or after ``WAIT_LIMIT_S`` of waiting, the process builds by itself.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
import time

try:
    import fcntl
except ImportError:          # (not on Windows: no lock, every process builds)
    fcntl = None

log = logging.getLogger("gdn_layer.kernels")
WAIT_LIMIT_S = 3600.0        # a builder still holding the lock after this long: build here as well
_held = threading.local()    # this thread's depth inside first_on_machine (a nested call must not wait on itself)


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


@functools.lru_cache(maxsize=1)
def software() -> dict:
    """What a build depends on besides the configuration: the compilers' and kernel libraries' versions, and a
    hash of this package's kernel sources (an upgrade or an edit gets a new key, so it is built again)."""
    from importlib import metadata
    found = {}
    for dist in ("torch", "triton", "fla-core", "flash-qla", "tilelang"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    here, digest = os.path.dirname(os.path.abspath(__file__)), hashlib.sha256()
    for root, _, files in sorted(os.walk(here)):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(root, name), "rb") as f:
                digest.update(name.encode() + f.read())
    found["gdn_layer.kernels"] = digest.hexdigest()[:16]
    return found


def runs_collectives(module) -> bool:
    """Whether ``module``'s forward may run collectives: parameters that are DTensors (FSDP2, tensor parallel)
    or an FSDP wrapper inside. Its ranks must then run together, so none may wait for another's build. (By class
    name: this package does not import torch.distributed.)"""
    return (any(any(c.__name__ == "DTensor" for c in type(p).__mro__) for p in module.parameters())
            or any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()))


def _lock(f) -> bool:
    """Take ``f``'s exclusive lock, waiting up to ``WAIT_LIMIT_S``; False where it cannot be taken."""
    deadline = time.monotonic() + WAIT_LIMIT_S
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                log.warning("warmup: another process has been building for over %.0f s; building here too",
                            WAIT_LIMIT_S)
                return False
            time.sleep(0.2)
        except OSError as e:     # ENOSYS / ENOLCK: a file system without flock
            log.info("warmup: no lock on this file system (%s); every process builds", e)
            return False


@contextlib.contextmanager
def first_on_machine(key: str, directory: str | None = None):
    """Run the body as the machine's one builder of ``key``, or after it has finished.

    Yields True when this process builds (no marker yet: it holds the lock for the body, and leaves the
    marker if the body returns), False when another process built ``key`` before (the body runs at once,
    concurrently with other such processes). A body that raises leaves no marker: the next waiter builds.
    Where no lock can be taken (module docstring), yields True without one.
    """
    directory = directory or cache_dir()
    marker = os.path.join(directory, f"gdn_layer_built_{key}")
    lock = None
    if fcntl is not None and not getattr(_held, "depth", 0):
        try:
            os.makedirs(directory, exist_ok=True)
            lock = open(os.path.join(directory, "gdn_layer_build.lock"), "a+")
        except OSError:
            lock = None
    if lock is None:
        yield True
        return
    with lock:
        if not _lock(lock):
            yield True
            return
        _held.depth = getattr(_held, "depth", 0) + 1
        try:
            if os.path.exists(marker):
                fcntl.flock(lock, fcntl.LOCK_UN)
                yield False
                return
            yield True
            with contextlib.suppress(OSError), open(marker, "w"):
                pass
        finally:
            _held.depth -= 1
            fcntl.flock(lock, fcntl.LOCK_UN)


__all__ = ["first_on_machine", "key_of", "cache_dir", "software", "runs_collectives", "WAIT_LIMIT_S"]
