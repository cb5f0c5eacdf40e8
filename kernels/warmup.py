"""``warmup(layer)``: compile every kernel variant a layer configuration can need, before training.

Our kernels and the chunk libraries specialise only on head counts, head dims, dtypes and a few flags,
never on lengths or sequence counts; so one small run per flag combination builds everything, and a
later packed layout of any total length and count compiles nothing (``benchmarks/compile_check.py``
shows it on a GPU; ``tests/test_triton_compile.py`` on CPU with Triton's real compiler).

The flag combinations: packed (``cu_seqlens``) and dense ``[B, T]`` inputs (the compiled CUDA backends
run a dense batch as a pack of B sequences, so for their chunk kernels this is one variant); with and
without an initial state and a returned state; the decode path (one token per sequence, the recurrent
kernel); each forward and backward; the serving pool's decode and verify calls (``state_slots``). A backend that picks a compiled variant from the number of
sequences (FlashQLA's V block: ``Backend.warmup_sequence_counts``) also gets one pack per such count. A
backend whose calls inside a CUDA graph capture take other kernels (FlashQLA hands the chunk op to fla
there: ``Backend.as_in_capture``) runs the packed training calls once more that way ("captured" jobs), so a
capture after ``warmup()`` compiles and autotunes nothing (both would sync, which a capture forbids).

Cold, the compiles dominate (FlashQLA's TileLang kernels take 10-35 s each on an H200). So on CUDA
``warmup`` starts ``workers`` child processes that build shares of the other calls into the shared disk
caches (a dense batch is left out where the backend runs it as a pack: the same kernels) while this process
runs the first call. When that call took longer than ``COLD_FIRST_CALL_S`` (the caches were cold), this
process waits for the children and then runs the other calls, loading what they built; otherwise (warm
caches) it stops the children, which are still starting, and runs the rest itself in seconds.
"""
from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import subprocess
import sys
import time
import types

import torch

from . import build_once

log = logging.getLogger("gdn_layer.kernels")
# backends whose layer a child process can rebuild by name (a backend registered at run time is not
# registered in a child)
_CHILD_BACKENDS = ("fla", "flash_qla")
# the first call took longer than this (seconds): the disk caches were cold, so the children's builds
# are waited for (else they are stopped)
COLD_FIRST_CALL_S = 15.0
# a child still building after this long (seconds) is stopped; this process then builds what it had left
_CHILD_LIMIT_S = 1800.0


def _backend(layer):
    """The registry entry the layer runs on (None for an unknown name)."""
    from .registry import backend_by_name
    try:
        return backend_by_name(layer.resolved_backend)
    except (KeyError, AttributeError):
        return None


def _sequence_counts(backend, num_v_heads: int) -> list[int]:
    """``backend.warmup_sequence_counts(num_v_heads)`` as sorted distinct Python ints (a registered
    backend's own code: checked here, before any call runs; ints also go to the children as JSON)."""
    fn = getattr(backend, "warmup_sequence_counts", None)
    if fn is None:
        return []
    got = fn(num_v_heads)
    what = f"backend {backend.name!r}: warmup_sequence_counts({num_v_heads}) must return positive ints"
    if isinstance(got, (str, bytes)) or not hasattr(got, "__iter__"):
        raise TypeError(f"{what}, got {got!r}")
    counts = set()
    for n in got:
        try:
            if isinstance(n, bool):
                raise TypeError
            n = operator.index(n)
        except TypeError:
            raise TypeError(f"{what}, got {n!r} ({type(n).__name__}) in {got!r}") from None
        if n < 1:
            raise ValueError(f"{what}, got {n} in {got!r}")
        counts.add(n)
    return sorted(counts)


def _jobs(layer, include_decode: bool, include_states: bool) -> list[tuple]:
    """The calls that cover every variant: ``(kind, n, initial_state?, output_state?, grad?)`` with kind
    "packed" (n sequences), "dense" (n rows), "decode" (n sequences of one token) or "captured" (a pack run
    under the backend's ``as_in_capture``)."""
    cp = getattr(layer, "cp_size", 1)
    combos = ((False, False), (False, True), (True, True), (True, False))
    if not include_states and cp == 1:
        combos = combos[:1]
    # under CP the layer takes packs only (B == 1); a dense row is one sequence, a pack of one
    jobs = [(kind, 2, st, out, True) for st, out in combos for kind in ("packed", "dense")[:1 if cp > 1 else 2]]
    backend = _backend(layer)
    # packs of other sequence counts where the backend picks a compiled variant from N (FlashQLA's V block)
    for n in _sequence_counts(backend, layer.heads.v_heads_per_rank):
        if n != 2:
            jobs += [("packed", n, st, out, True) for st, out in combos]
    if getattr(backend, "as_in_capture", None) is not None:
        jobs += [("captured", 2, st, out, True) for st, out in combos]
    if include_decode and include_states and layer.sp_size * cp == 1:   # decode: T = N is not split across ranks
        jobs += [("decode", 3, True, out, grad) for grad in (False, True) for out in (True, False)]
        # the serving pool (gdn_layer/pool.py): a decode step with a padding row, and a verify call with
        # checkpoints after every token (its rounds run the decode path); inference only
        jobs += [("pool", 3, True, False, False)]
    return jobs


def _run_jobs(layer, dtype, jobs) -> None:
    from gdn_layer.layer import GatedDeltaNet  # imported here to keep kernels/ standalone
    # through the module's __call__ (its hooks run: FSDP2 gathers sharded parameters there), with the
    # layer's own forward: a transformers-interface subclass (gdn_layer.hf) takes the model's cache instead
    # of state / output_state but runs the same kernels, so GatedDeltaNet.forward stands in on the instance
    # for the duration of the calls
    # (an instance-level forward already there, e.g. a hook library's wrapper, is put back afterwards)
    own = isinstance(layer, GatedDeltaNet) and type(layer).forward is not GatedDeltaNet.forward
    missing = object()
    before = layer.__dict__.get("forward", missing)
    if own:
        layer.forward = types.MethodType(GatedDeltaNet.forward, layer)
    try:
        _run_job_list(layer, dtype, jobs)
    finally:
        if own:
            if before is missing:
                del layer.forward
            else:
                layer.forward = before


def _run_job_list(layer, dtype, jobs) -> None:
    from gdn_layer.state import GDNState, state_dtype

    p = layer.out_proj.weight    # the activations' dtype (A_log, dt_bias may be kept in fp32)
    device, P = p.device, layer.sp_size * getattr(layer, "cp_size", 1)    # ranks a pack is sliced over
    params = [q for q in layer.parameters() if q.requires_grad]
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != p.dtype
                else torch.autocast(device.type, enabled=False))

    sdt = state_dtype(dtype)
    # inputs from a fixed seed of our own, drawn on the CPU: the same on every rank whatever each rank's
    # global RNG (ranks commonly seed base + rank), since under SP / CP the layer checks that the ranks
    # pass the same state; and the global RNG is not drawn from
    gen = torch.Generator().manual_seed(0x6D4)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device)

    def state(n):
        return GDNState(randn(n, layer.conv_dim, layer.conv_kernel_size - 1, dtype=sdt),
                        randn(n, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype=sdt) * 0.1)

    as_in_capture = getattr(_backend(layer), "as_in_capture", None) or contextlib.nullcontext
    for kind, n, st, out_state, grad in jobs:
        if kind == "pool":
            _run_pool_job(layer, n, randn, dtype, autocast)
            continue
        in_capture = as_in_capture() if kind == "captured" else contextlib.nullcontext()
        if kind == "decode":                 # one token per sequence, not split across ranks
            B, T_local, cu = 1, n, torch.arange(n + 1, device=device)
        else:
            # two chunks per rank (more for many sequences), a sequence boundary mid-chunk, T divisible by P
            T = 2 * 64 * P * max(1, -(-n // (2 * 64)))
            B, T_local, cu = 1, T // P, (torch.div(torch.arange(n + 1, device=device) * T, n, rounding_mode="floor")
                                         if n != 2 else torch.tensor([0, 37 * P, T], device=device))
            if kind == "dense":
                B, cu = n, None
        x = randn(B, T_local, layer.hidden_size, dtype=dtype)
        x.requires_grad_(grad)
        with torch.set_grad_enabled(grad), autocast, in_capture:
            res = layer(x, cu_seqlens=cu, state=state(n) if st else None, output_state=out_state)
            y, new = (res if out_state else (res, None))
            if grad:
                loss = y.float().square().mean() + (0 if new is None else new.recurrent_state.square().mean())
                torch.autograd.grad(loss, [x, *params], allow_unused=True)


def _run_pool_job(layer, n, randn, dtype, autocast) -> None:
    """A pooled decode step of ``n`` sequences (one of them padding) and a verify call of 2 tokens per
    sequence with a checkpoint after each (``forward(state=pool, state_slots=...)``), under no_grad."""
    device = layer.out_proj.weight.device
    pool = layer.new_state(3 * n)
    slots = torch.arange(n, device=device)
    slots[1] = -1
    ck = torch.arange(n, 3 * n, device=device).reshape(n, 2)
    with torch.no_grad(), autocast:
        layer(randn(n, 1, layer.hidden_size, dtype=dtype), state=pool, state_slots=slots)
        layer(randn(1, 2 * n, layer.hidden_size, dtype=dtype), cu_seqlens=torch.arange(0, 2 * n + 1, 2, device=device),
              state=pool, state_slots=slots, checkpoint_slots=ck, checkpoint_every=1)


def _default_workers() -> int:
    """Half the CPUs this process may use, at least 1 and at most 8 (the local ranks of a torchrun launch do
    not share them: one process of the machine builds while the others wait, ``_first_on_machine``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return min(8, max(1, cpus // 2))


def _cuda_devices(device: torch.device) -> list[int]:
    """``[index]`` of a CUDA device (an index-less ``"cuda"`` is the current one), ``[]`` otherwise."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _spec(layer, dtype) -> dict | None:
    """What a child process needs to rebuild this layer's kernels, or None when it cannot."""
    p = layer.out_proj.weight    # the activations' dtype (A_log, dt_bias may be kept in fp32)
    if (p.device.type != "cuda" or layer.sp_size != 1 or getattr(layer, "cp_size", 1) != 1
            or layer.resolved_backend not in _CHILD_BACKENDS):
        return None
    return {"args": [layer.hidden_size, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim],
            "kwargs": {"conv_kernel_size": layer.conv_kernel_size, "norm_eps": layer.norm.eps,
                       "projection_layout": layer.projection_layout, "backend": layer.resolved_backend},
            "param_dtype": str(p.dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
            # parameters kept in another dtype (fp32 A_log / norm weight in a bf16 model): their own kernels
            "other_dtypes": {n: str(q.dtype).removeprefix("torch.") for n, q in layer.named_parameters()
                             if q.dtype != p.dtype},
            "device": f"cuda:{_cuda_devices(p.device)[0]}"}


def _start_children(spec: dict, jobs: list, workers: int) -> list:
    """Start ``workers`` child processes (``python -m gdn_layer.kernels._warmup_child``), each running its
    share of ``jobs``; returns ``[(process, stderr file)]``. Their stderr goes to a temporary file (a
    pipe that nobody drains would stall a child that logs a lot, as TileLang's compiler does)."""
    import tempfile

    import gdn_layer
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(gdn_layer.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    children = []
    try:
        for w in range(workers):
            share = jobs[w::workers]
            if share:
                # errors="replace": a compiler's output need not be UTF-8, and a failed decode while
                # logging a child would raise out of warmup before the other children are stopped
                err = tempfile.TemporaryFile(mode="w+", errors="replace")
                try:
                    proc = subprocess.Popen([sys.executable, "-m", "gdn_layer.kernels._warmup_child"],
                                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                            text=True)
                except BaseException:
                    err.close()
                    raise
                children.append((proc, err))
                proc.stdin.write(json.dumps({**spec, "jobs": share}))
                proc.stdin.close()
    except BaseException as e:
        # children only build ahead of this process, which runs every call anyway: stop those started
        # (none is left running behind warmup) and go on without them; an interrupt still propagates
        _finish_children(children, wait=False)
        if not isinstance(e, OSError):      # OSError: no interpreter, BrokenPipeError from a dead child
            raise
        log.warning("warmup: could not start child processes (%s: %s); building in this process only",
                    type(e).__name__, e)
        return []
    return children


def _finish_children(children: list, wait: bool) -> None:
    """Wait for the children (``wait``; at most ``_CHILD_LIMIT_S`` in all) or stop those still running
    (what they were building, this process builds after them); a child that failed is logged, not
    raised. Each child is handled once: a second call skips those already finished."""
    deadline = time.monotonic() + _CHILD_LIMIT_S
    for proc, err in children:
        if err.closed:
            continue
        if wait:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("warmup: a child process still building after %.0f s was stopped", _CHILD_LIMIT_S)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        elif proc.returncode != 0:
            err.seek(0)
            log.warning("warmup: a child process failed (rc %s):\n%s", proc.returncode, err.read()[-2000:])
        err.close()


def _child_main() -> None:
    spec = json.loads(sys.stdin.read())
    from gdn_layer import GatedDeltaNet
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layer = GatedDeltaNet(*spec["args"], **spec["kwargs"], device=device, dtype=getattr(torch, spec["param_dtype"]))
    params = dict(layer.named_parameters())
    for name, dt in spec.get("other_dtypes", {}).items():
        if name in params:     # (a subclass's own names, e.g. OLMo-Hybrid's, do not exist here: skipped)
            params[name].data = params[name].data.to(getattr(torch, dt))
    _run_jobs(layer, getattr(torch, spec["dtype"]), [tuple(j) for j in spec["jobs"]])
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warmup(layer, dtype: torch.dtype | None = None, include_decode: bool = True, include_states: bool = True,
           workers: int | None = None) -> float:
    """Run ``layer`` forward and backward over small inputs that cover every kernel variant.

    Args:
        layer: a ``gdn_layer.GatedDeltaNet`` (under SP or CP every rank of its groups must call this
            too: it runs the layer's collectives, on this rank's slices of packs; with ``cp_group`` only
            packs, no dense batch and no decode, which CP does not take).
        dtype: activation dtype to build for (default: the layer's parameter dtype); another dtype runs
            under ``torch.autocast`` with it, as mixed-precision training does.
        include_decode: also build the decode path (one token per sequence; it carries states, so only
            with ``include_states``).
        include_states: also build the variants that take an initial state and/or return the final
            state (continuing sequences, decode). False builds only what training without states runs
            (FlashQLA's kernels take 15-20 s each to build cold on an H200); a layer with ``cp_group``
            uses states internally, so it always builds them.
        workers: child processes that build the other variants while this process runs the first call,
            waited for when that call shows cold disk caches (over ``COLD_FIRST_CALL_S``), else stopped
            (CUDA, backend ``fla`` or ``flash_qla``, no sp/cp group; elsewhere 0). Default: half the CPUs
            this process may use, 1 to 8; 0 where another process of the machine built this configuration
            (below). They share this process's
            environment (``TRITON_CACHE_DIR``, ``TILELANG_CACHE_DIR``, ``CUDA_VISIBLE_DEVICES``) and build
            into the disk caches; 0 builds in this process only.

    One build per machine (CUDA, no sp/cp group): the first process to warm a configuration builds it
    while the machine's other processes warming the same one wait (a lock file beside Triton's cache,
    ``kernels/build_once.py``), then load what it built; no collective, so a rank may call this alone.

    Returns:
        seconds spent. Parameter ``.grad`` fields are left untouched (gradients are taken with
        ``torch.autograd.grad``), and so is the global random state (CPU and the layer's GPU): the
        inputs come from warmup's own generator with a fixed seed, identical on every SP / CP rank
        whatever each rank's global seed (the layer checks that ranks pass the same state).
        On CPU (torch backend) nothing is compiled or cached: it only runs the calls once.

    Raises:
        ValueError: ``workers`` negative; ``dtype`` neither the parameters' dtype nor (for float32
        parameters) bfloat16 / float16; a backend's ``warmup_sequence_counts`` not positive.
        TypeError: ``workers`` not an int; ``dtype`` not a floating-point ``torch.dtype``; a backend's
        ``warmup_sequence_counts`` not ints.
    """
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise TypeError(f"workers must be an int or None, got {type(workers).__name__}")
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    p = layer.out_proj.weight    # the activations' dtype (A_log, dt_bias may be kept in fp32)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be None or a floating-point torch.dtype, got {dtype!r}")
    dtype = dtype or p.dtype
    if dtype != p.dtype and not (p.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)):
        raise ValueError(f"dtype {dtype} cannot run a layer with {p.dtype} parameters: pass {p.dtype}, or "
                         "bfloat16 / float16 for a float32 layer (it then runs under torch.autocast)")
    t0 = time.perf_counter()
    jobs = _jobs(layer, include_decode, include_states)
    spec = _spec(layer, dtype)
    with _first_on_machine(layer, dtype, jobs) as building:
        if workers is None:
            workers = _default_workers() if spec is not None and building else 0
        _warm(layer, dtype, jobs, spec, workers, t0)
    return time.perf_counter() - t0


def _first_on_machine(layer, dtype, jobs):
    """``build_once.first_on_machine`` for a CUDA layer whose forward runs no collective (no SP / CP group, no
    FSDP or DTensor parameters: those ranks must run together, so none may wait); else every process builds."""
    p = layer.out_proj.weight
    if (p.device.type != "cuda" or layer.sp_size != 1 or getattr(layer, "cp_size", 1) != 1
            or build_once.runs_collectives(layer)):
        return contextlib.nullcontext(True)
    shape = [layer.hidden_size, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
             layer.conv_kernel_size, layer.projection_layout]
    return build_once.first_on_machine(build_once.key_of(
        type(layer).__name__, shape, layer.resolved_backend, {n: str(q.dtype) for n, q in layer.named_parameters()},
        str(dtype), jobs, build_once.software(), torch.cuda.get_device_name(p.device), os.environ.get("FLA_FLASH_QLA")))


def _warm(layer, dtype, jobs, spec, workers, t0) -> None:
    p = layer.out_proj.weight
    # the random inputs do not move the caller's RNG; the backward is part of what is built, also when
    # serving under inference_mode
    first, rest = jobs[:1], jobs[1:]
    backend = _backend(layer)
    child_jobs = [j for j in rest if not (j[0] == "dense" and getattr(backend, "dense_as_packed", False))]
    children = (_start_children(spec, child_jobs, min(workers, len(child_jobs)))
                if child_jobs and workers > 0 and spec is not None else [])
    try:
        with torch.random.fork_rng(devices=_cuda_devices(p.device)), torch.inference_mode(False):
            _run_jobs(layer, dtype, first)
            # cold caches: wait for the children's builds (building the same kernel here at the same
            # time would only slow both), then load them; warm: the children are not needed
            _finish_children(children, wait=time.perf_counter() - t0 > COLD_FIRST_CALL_S)
            _run_jobs(layer, dtype, rest)
    finally:
        _finish_children(children, wait=False)      # an error or interrupt: none is left running
    if p.device.type == "cuda":
        torch.cuda.synchronize(p.device)
