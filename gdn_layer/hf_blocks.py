"""From a transformers GatedDeltaNet block to a ``GatedDeltaNet``: which families match, the
constructor arguments, an exact copy of the weights (each parameter keeps its dtype), and a check of
the copy against the block on a small random input before anyone uses it.

No import of ``gdn_layer.layer`` (the class to build is passed in), so ``GatedDeltaNet.from_hf`` can
import this module and the dependency runs one way: ``layer`` -> ``hf_blocks`` <- ``hf``.

Families of transformers 5.24 with a GatedDeltaNet block (docs/layer.md has the table):
``qwen3_next`` (fused projections), ``qwen3_5``, ``qwen3_5_moe``, ``lara_mini``, ``qwen4_exp`` (split
projections; ``qwen4_exp`` also with ``output_gate_type="sigmoid"``, a sigmoid output gate), and
``olmo_hybrid`` (separate ``q_proj / k_proj / v_proj / a_proj / b_proj / g_proj`` projections, ``o_norm``
with transformers' fixed eps 1e-5, ``o_proj``, ``allow_neg_eigval`` doubling beta), which converts only
into a class with its parameter names (``gdn_layer.hf.HFOlmoHybridGatedDeltaNet``, ``olmo_layout``).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

TESTED = ((5, 24), (5, 26))      # the transformers versions the adapter is tested with: >= 5.24, < 5.26
TESTED_TEXT = ">=5.24,<5.26"
SUPPORTED = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "lara_mini", "qwen4_exp", "olmo_hybrid")
OLMO_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")


def gated_norm(m: nn.Module) -> nn.Module:
    """The gated RMSNorm of a block (``o_norm`` in OLMo-Hybrid's)."""
    return m.o_norm if hasattr(m, "o_norm") else m.norm


def output_projection(m: nn.Module) -> nn.Module:
    """The output projection of a block (``o_proj`` in OLMo-Hybrid's)."""
    return m.o_proj if hasattr(m, "o_proj") else m.out_proj


def family(hf_module: nn.Module) -> str:
    """The transformers model family of a block (``"qwen3_5"`` for ``transformers.models.qwen3_5...``),
    or its class's module path when it comes from elsewhere."""
    parts = type(hf_module).__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["transformers", "models"] else type(hf_module).__module__


def is_gated_deltanet_block(m: nn.Module) -> bool:
    """A transformers GatedDeltaNet block (of any family; ``hf_sizes`` decides if it can be converted)."""
    return type(m).__name__.endswith("GatedDeltaNet") and type(m).__module__.startswith("transformers.")


def hf_sizes(hf_module: nn.Module) -> dict:
    """Constructor arguments of ``GatedDeltaNet`` (plus ``output_gate``, and ``allow_neg_eigval`` for
    OLMo-Hybrid's layout) for a transformers block.

    Raises:
        TypeError: ``hf_module`` is no GatedDeltaNet block of a known layout (names its class and family).
        ValueError: a feature of the block that ``GatedDeltaNet`` does not compute (names it): a conv
            activation other than SiLU, a conv or projection bias, an output gate other than SiLU / sigmoid.
    """
    fam = family(hf_module)
    if type(hf_module).__module__.startswith("gdn_layer"):
        raise TypeError(f"hf_module is already a gdn_layer {type(hf_module).__name__} (a converted block): use it "
                        "as it is, or copy.deepcopy it; from_hf converts transformers blocks")
    if hasattr(hf_module, "in_proj_qkvz"):
        layout, projections = "fused", ("in_proj_qkvz", "in_proj_ba")
    elif hasattr(hf_module, "in_proj_qkv"):
        layout, projections = "split", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    elif all(hasattr(hf_module, n) for n in OLMO_PROJECTIONS):
        layout, projections = "olmo_hybrid", OLMO_PROJECTIONS
    else:
        raise TypeError(f"hf_module must be a transformers GatedDeltaNet block (with in_proj_qkvz, in_proj_qkv, or "
                        f"OLMo-Hybrid's q/k/v/a/b/g_proj), got {type(hf_module).__name__} of family {fam}")
    activation = getattr(hf_module, "activation", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"{fam} block: only the SiLU conv activation is supported, hf_module uses {activation!r}")
    norm, out = gated_norm(hf_module), output_projection(hf_module)
    for name, m in [(n, getattr(hf_module, n)) for n in (*projections, "conv1d")] + [("output projection", out)]:
        if getattr(m, "bias", None) is not None:
            raise ValueError(f"{fam} block: {name} has a bias, which GatedDeltaNet does not have")
    gate = getattr(norm, "activation", "silu")
    gate = {"swish": "silu"}.get(gate, gate)
    if gate not in ("silu", "sigmoid"):
        raise ValueError(f"{fam} block: output gate activation {gate!r} (norm.activation); GatedDeltaNet supports "
                         "'silu' and 'sigmoid'")
    eps = getattr(norm, "variance_epsilon", None)
    extra = {} if layout != "olmo_hybrid" else {"allow_neg_eigval": bool(hf_module.allow_neg_eigval)}
    return dict(**extra, hidden_size=hf_module.hidden_size, num_k_heads=hf_module.num_k_heads,
                num_v_heads=hf_module.num_v_heads, head_k_dim=hf_module.head_k_dim,
                head_v_dim=hf_module.head_v_dim, conv_kernel_size=hf_module.conv_kernel_size,
                norm_eps=hf_module.layer_norm_epsilon if eps is None else eps,
                projection_layout="split" if layout == "olmo_hybrid" else layout,
                output_gate=gate)


def build(cls, hf_module: nn.Module, sp_group=None, backend: str = "auto", cp_group=None, check: bool = True):
    """A ``cls`` (``GatedDeltaNet`` or a subclass) with the sizes, an exact copy of the weights and the
    flags of ``hf_module``: each parameter's dtype (an fp32 ``A_log`` in a bf16 block stays fp32, bit
    for bit), ``requires_grad`` and transformers' ``_is_hf_initialized``, each submodule's ``training``.
    With ``check``, the copy is run against the block first (``verify``).

    Raises:
        TypeError: as ``hf_sizes``; an OLMo-Hybrid block and a ``cls`` without its parameter names (or
            the reverse).
        ValueError: as ``hf_sizes``; the block's weights offloaded by accelerate hooks; ``verify`` failed.
    """
    sizes = hf_sizes(hf_module)
    gate = sizes.pop("output_gate")
    if ("allow_neg_eigval" in sizes) != bool(getattr(cls, "olmo_layout", False)):
        raise TypeError(f"a {family(hf_module)} block converts only into "
                        + ("gdn_layer.hf.HFOlmoHybridGatedDeltaNet, which keeps its parameter names (q_proj, ..., "
                           "o_norm, o_proj): use gdn_layer.hf.from_hf or swap_gated_deltanet"
                           if "allow_neg_eigval" in sizes else "a class with its parameter names, not " + cls.__name__))
    if any(getattr(m, "_hf_hook", None) is not None for m in hf_module.modules()) and any(
            t.device.type == "meta" for t in hf_module.parameters()):
        raise ValueError(f"the {family(hf_module)} block's weights are offloaded by accelerate hooks (on meta until "
                         "its forward): a copy would hold no weights. Convert before offloading: load without an "
                         "offloading device_map, swap, then accelerate.cpu_offload / dispatch_model")
    p = output_projection(hf_module).weight
    layer = cls(**sizes, sp_group=sp_group, cp_group=cp_group, backend=backend, device=p.device, dtype=p.dtype)
    layer.norm.gate = gate
    old_params = dict(hf_module.named_parameters())
    for name, param in list(layer.named_parameters()):
        old = old_params[name]
        if old.dtype != param.dtype:  # e.g. transformers' fp32 A_log / norm weight in a bf16 model
            owner, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(owner), leaf, nn.Parameter(torch.empty_like(param, dtype=old.dtype)))
    layer.load_state_dict(hf_module.state_dict(), strict=True)
    old_modules = dict(hf_module.named_modules())
    for name, param in layer.named_parameters():
        param.requires_grad_(old_params[name].requires_grad)
        if getattr(old_params[name], "_is_hf_initialized", False):
            param._is_hf_initialized = True
    for name, module in layer.named_modules():
        old = old_modules.get(name, hf_module)
        module.training = old.training
        if getattr(old, "_is_hf_initialized", False):
            module._is_hf_initialized = True
    if hasattr(cls, "layer_idx"):   # speaks transformers' block interface: verify runs it from a cache
        layer.layer_idx = getattr(hf_module, "layer_idx", 0)
    if check:
        verify(layer if layer.sp_size * layer.cp_size == 1 else
               build(cls, hf_module, backend=backend, check=False), hf_module)
    return layer


def _tolerance(dtype: torch.dtype) -> float:
    # transformers computes parts of an fp64 block in fp32 (its gated norm), so fp64 is held to fp32 rounding
    return {torch.float64: 1e-4, torch.float32: 1e-4}.get(dtype, 5e-2)


def verify(layer: nn.Module, hf_module: nn.Module, length: int = 11) -> None:
    """Run ``layer`` and ``hf_module`` on one random ``[1, length, hidden]`` input (a fixed seed of its
    own: the caller's random state is untouched) and raise if they differ beyond the dtype's rounding:
    one forward, then from a transformers cache a prefill of ``length - 1`` tokens and one decode step
    (outputs, the stored recurrent state and, where the cache counts them, the tokens seen), and, where the
    cache records states for speculative decoding (transformers >= 5.25), a 3-token call rolled back by one.
    ``layer`` continues from the cache through transformers' block interface when it has one
    (``gdn_layer.hf.HFGatedDeltaNet``), else from a ``GDNState``. Skipped when the block's weights hold no
    values (``meta``: nothing can run).

    Raises:
        ValueError: naming the family, the block's class, which check differs and by how much: the block
            computes something the conversion does not (a feature this adapter does not know), or the
            installed transformers stores the cache in a way the adapter does not follow.
    """
    p = output_projection(hf_module).weight
    if p.device.type == "meta" or any(t.device.type == "meta" for t in hf_module.parameters()):
        return
    x = torch.randn(1, length, layer.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(device=p.device, dtype=p.dtype)
    with torch.no_grad(), _quiet_transformers():
        _compare("a forward", layer(x), hf_module(x), hf_module)
        for what, want, got in _cached_runs(layer, hf_module, x):
            _compare(what, got, want, hf_module)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' logging at error level while the check runs its blocks: their notices (a fallback kernel
    "falling back to its reference PyTorch implementation") would read as if the swapped model ran them."""
    from transformers.utils import logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, hf_module: nn.Module) -> None:
    got, want = got.double(), want.double()
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if not err <= _tolerance(output_projection(hf_module).weight.dtype):
        import transformers
        raise ValueError(
            f"the {family(hf_module)} block {type(hf_module).__name__} and its GatedDeltaNet copy differ on {what} "
            f"(relative difference {err:.3g} on a random input; output gate "
            f"{getattr(gated_norm(hf_module), 'activation', 'silu')!r}, conv activation "
            f"{getattr(hf_module, 'activation', 'silu')!r}, transformers {transformers.__version__}): this block has "
            f"a feature the adapter does not support, or this transformers version keeps its cache in a way the "
            f"adapter does not follow, so it is not replaced. gdn_layer.hf is tested with transformers "
            f"{TESTED_TEXT}: under another version install one of those (pip install 'transformers{TESTED_TEXT}'), "
            f"else report the block and this message")


def _cached_runs(layer: nn.Module, hf_module: nn.Module, x: torch.Tensor):
    """``(what, block's, copy's)`` tensors of a prefill + decode step from a fresh transformers cache, and of
    a speculative call rolled back by one token where the cache supports it."""
    from transformers.cache_utils import Cache, LinearAttentionLayer
    idx = getattr(hf_module, "layer_idx", None)
    if not isinstance(idx, int):     # a block built without its place in a model cannot use a cache
        return
    speaks_cache = getattr(layer, "layer_idx", None) == idx

    def new_cache():
        return Cache(layers=[LinearAttentionLayer() for _ in range(idx + 1)])

    prefill, step = x[:, :-1], x[:, -1:]
    block_cache = new_cache()
    want = torch.cat([hf_module(prefill, cache=block_cache), hf_module(step, cache=block_cache)], 1)
    if speaks_cache:
        copy_cache = new_cache()
        got = torch.cat([layer(prefill, cache=copy_cache), layer(step, cache=copy_cache)], 1)
    else:                                   # a plain GatedDeltaNet: its own state
        y, state = layer(prefill, output_state=True)
        got = torch.cat([y, layer(step, state=state)], 1)
    yield "a prefill and a cached decode step", want, got
    if not speaks_cache:
        return
    yield ("the recurrent state in the cache", block_cache.get_recurrent_state(idx),
           copy_cache.get_recurrent_state(idx))
    if hasattr(block_cache.layers[idx], "get_seq_length"):
        seen = [float(c.layers[idx].get_seq_length()) for c in (block_cache, copy_cache)]
        yield "the tokens the cache counts", torch.tensor(seen[:1]), torch.tensor(seen[1:])
    if not hasattr(block_cache, "get_recurrent_states_to_keep"):
        return
    outs = []
    for module in (hf_module, layer):   # record, verify 3 tokens, reject the last, decode one more
        cache = new_cache()
        module(x[:, :-4], cache=cache)
        cache.activate_past_recording(recurrent_states_to_keep=2)
        module(x[:, -4:-1], cache=cache)
        cache.layers[idx].crop(-1)   # (Cache.crop would also crop the unused layers before idx)
        outs.append(module(x[:, -2:-1], cache=cache))
    yield "a speculative call rolled back by one token", outs[0], outs[1]
