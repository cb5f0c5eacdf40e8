"""The layer's argument checks, and the rank-agreement step that lets every SP / CP rank raise together.

``check_config`` runs in the constructor; ``check_inputs`` at the top of every forward, before any
kernel launch or collective: local checks (``check_local``: types, shapes, dtypes, devices,
``cu_seqlens``, the state, NaN values where value checks are on), then under SP / CP one small
all-reduce of a digest of what every rank must agree on (input shape and dtype, ``cu_seqlens``, the
state, the weights), so a rank at fault and its peers raise together instead of hanging in the
all-to-all.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn

from gdn_layer.context_parallel import whole_sequence_cu
from gdn_layer.kernels import check_cu_seqlens
from gdn_layer.kernels.cu_cache import as_int64
from gdn_layer.kernels.validation import check_no_nan, values_checkable
from gdn_layer.parallel import digest_of
from gdn_layer.parallel.context import agree_across_groups
from gdn_layer.projection_layouts import IN_PROJECTIONS
from gdn_layer.state import check_state
from gdn_layer.submodules import check_conv1d
from gdn_layer.token_order import prepare_token_order

_shared_int64 = torch.compiler.disable(as_int64)

DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def positive_int(name: str, value) -> int:
    """``value`` as a Python int: any integral number (``int``, numpy's integer scalars; not ``bool``) > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def check_config(hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size, norm_eps,
                 projection_layout, dtype) -> tuple[int, int, int, int, int, int]:
    """The constructor's argument checks (TypeError / ValueError naming the argument); returns the six sizes
    as Python ints (numpy integers from a config are accepted)."""
    sizes = tuple(positive_int(name, value) for name, value in (
        ("hidden_size", hidden_size), ("num_k_heads", num_k_heads), ("num_v_heads", num_v_heads),
        ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim), ("conv_kernel_size", conv_kernel_size)))
    hidden_size, num_k_heads, num_v_heads = sizes[:3]
    if num_v_heads % num_k_heads != 0:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)):
        raise TypeError(f"norm_eps must be a float, got {type(norm_eps).__name__}")
    if not 0 < norm_eps < float("inf"):
        raise ValueError(f"norm_eps must be positive and finite, got {norm_eps}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if projection_layout not in ("split", "fused"):
        raise ValueError(f"projection_layout must be 'split' or 'fused', got {projection_layout!r}")
    return sizes


def bits_fingerprint(tensors) -> torch.Tensor:
    """A digest of the exact integer sums of each tensor's raw bit patterns (order-independent)."""
    with torch.no_grad():
        bits = (t.detach().contiguous().reshape(-1).view(SAME_SIZE_INT.get(t.element_size(), torch.uint8))
                for t in tensors)
        sums = [b.sum(dtype=torch.int64) for b in bits]
    return digest_of(torch.stack(sums).cpu()) if sums else digest_of(0)


def check_inputs(layer, x, cu_seqlens, state, output_state, token_order=None):
    """All argument checks; under SP with value checks on, one all-reduce so ranks fail together.
    Returns the int64 ``cu_seqlens`` (or None) and the ``token_order`` plan (or None)."""
    error, cu, held = None, None, None
    try:
        cu = check_local(layer, x, cu_seqlens, state, output_state)
        held = prepare_token_order(layer, token_order, x, cu)
    except Exception as e:   # noqa: BLE001 - whatever a malformed input raises must reach the agreement
        error = e            # below (re-raised as it is), or the other ranks would wait in it
    # Whether ranks compare notes must not depend on this rank's input (a bad input on one rank
    # would skip the collective the others wait in): decide by the parameters' device.
    if layer.sp_size * layer.cp_size > 1 and values_checkable(layer.A_log):
        # the digest reads cu_seqlens on the host: only when value checks are on, and only of inputs
        # that passed the local checks (a malformed one is this rank's error)
        digest = digest_of(-1)
        if error is None:
            try:
                state_part = [] if state is None else [
                    DTYPE_CODE.get(state.conv_state.dtype, 99), DTYPE_CODE.get(state.recurrent_state.dtype, 99),
                    int(state.conv_state.requires_grad), int(state.recurrent_state.requires_grad),
                    bits_fingerprint([state.conv_state, state.recurrent_state])]
                # grad mode, autocast and whether x needs a gradient too: a rank differing there would
                # exchange other dtypes or wait in a backward the others never run
                digest = digest_of(
                    *x.shape, DTYPE_CODE.get(x.dtype, 99), int(state is not None), int(output_state),
                    int(torch.is_grad_enabled()), int(x.requires_grad), int(x.is_inference()),
                    int(x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)),
                    *([] if cu is None else [cu.cpu()]), weights_fingerprint(layer), *state_part,
                    None if held is None else held.order.cpu())
            except Exception as e:   # noqa: BLE001
                error = e
        agree_across_groups((layer.sp_group, layer.cp_group), digest, error,
                            "hidden_states (shape, dtype, requires_grad, inference tensor or not), grad mode "
                            "and autocast, cu_seqlens, token_order, the state (presence, dtype, values, "
                            "requires_grad) and the layer's weights")
    if error is not None:
        raise error
    return cu, held

def weights_fingerprint(layer) -> torch.Tensor:
    """A digest of the sums of every parameter's raw bit patterns (read as integers): equal on every
    rank when the weights are bit-identical, different (but for a cancelling coincidence) when any
    weight differs, e.g. ranks initialised differently, or an optimizer step after a missing
    ``reduce_sp_grads``, which would otherwise give silently wrong results. Integer sums are exact:
    no summation order or thread count changes them (a float sum's rounding does). One pass over
    the weights, no copy."""
    # parameters on meta (an accelerate offload hook restores them only around their module's own
    # forward) have no values to compare; the layer's own A_log and dt_bias are always there
    return bits_fingerprint([p for p in layer.parameters() if p.device.type != "meta"])


def _check_projection_dtypes(layer, x) -> None:
    """Outside autocast, every input projection that is an ``nn.Linear`` computes in x's dtype: one cast apart
    (``layer.in_proj_z.to(torch.bfloat16)``) fails in the GEMM with torch's "same dtype" error otherwise. Other
    module types (LoRA wrappers, bitsandbytes' or torchao's ``nn.Linear`` subclasses) manage their own dtypes."""
    for name in IN_PROJECTIONS[layer.projection_layout]:
        m = layer._modules.get(name)          # (an adapter of another family may name its projections otherwise)
        w = getattr(m, "weight", None)
        if type(m) is nn.Linear and isinstance(w, torch.Tensor) and w.dtype != x.dtype:
            raise TypeError(f"{name}.weight is {w.dtype} but hidden_states is {x.dtype}: the input projections "
                            "must share the input's dtype (cast the whole layer, layer.to(dtype)), or run under "
                            "torch.autocast")


def check_local(layer, x, cu_seqlens, state, output_state):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"hidden_states must be [B, T, hidden], got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError("hidden_states has batch size B = 0; pass at least one sequence")
    if x.shape[-1] != layer.hidden_size:
        raise ValueError(f"hidden_states.shape[-1] must equal hidden_size = {layer.hidden_size}, "
                         f"got {x.shape[-1]}")
    p = layer.out_proj.weight
    autocast_on = x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)
    autocast = autocast_on and p.dtype == torch.float32 and x.dtype == torch.get_autocast_dtype(x.device.type)
    if x.dtype != p.dtype and not autocast:
        raise TypeError(f"hidden_states dtype {x.dtype} differs from the layer's parameters ({p.dtype}); "
                        "cast one of them, or run under torch.autocast with that dtype")
    if not autocast_on:
        _check_projection_dtypes(layer, x)
    # the layer's own parameter: submodules' may sit on meta until their accelerate hooks restore them
    if x.device != layer.A_log.device:
        raise ValueError(f"hidden_states is on {x.device} but the layer's parameters are on {layer.A_log.device}")
    check_conv1d(layer.conv1d)
    if not isinstance(output_state, bool):
        raise TypeError(f"output_state must be a bool, got {type(output_state).__name__}")
    B, T_local = x.shape[:2]
    P = layer.sp_size * layer.cp_size
    T = T_local * P
    cu = None
    if layer.cp_size > 1 and B != 1:
        raise ValueError(f"with cp_group the batch must be packed into B == 1 (with cu_seqlens), got B = {B}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {B}")
        hint = "" if P == 1 else (
            f"under SP the packed length is the global T = SP size {layer.sp_size} x hidden_states.shape[1]: "
            f"each rank passes its T/P slice (gdn_layer.parallel.shard_sequence), and a T not divisible by "
            f"the SP size is padded first with gdn_layer.parallel.pad_for_sp") if layer.cp_size == 1 else (
            f"under CP the packed length is the global T = cp size {layer.cp_size} x SP size {layer.sp_size} x "
            f"hidden_states.shape[1]: rank (cp c, sp s) passes slice c*{layer.sp_size} + s, and a T not "
            f"divisible by cp*sp = {P} is padded first with "
            f"gdn_layer.parallel.pad_for_sp(hidden_states, cu_seqlens, {P})")
        cu = check_cu_seqlens(cu_seqlens, T, device=x.device, length_hint=hint)
        if layer.cp_size > 1 and torch.compiler.is_compiling():
            # the shared eager copy (kernels.cu_cache), not one made in the graph at every call: the cp
            # plans are cached per cu tensor, and a new tensor per call would read cu on the host each call
            cu = _shared_int64(cu_seqlens, x.device)
    elif layer.cp_size > 1:  # one sequence: the slices still hand its state on
        cu = whole_sequence_cu(T, x.device)
    n = B if cu is None else cu.numel() - 1
    check_no_nan("hidden_states", x, finite=True)
    if state is not None:
        check_state(state, n, layer.conv_dim, layer.conv_kernel_size, layer.num_v_heads,
                    layer.head_k_dim, layer.head_v_dim, x.device, x.dtype)
        check_no_nan("state.conv_state", state.conv_state, finite=True)
        check_no_nan("state.recurrent_state", state.recurrent_state, finite=True)
    return cu


__all__ = ["check_config", "check_inputs", "check_local", "positive_int", "weights_fingerprint", "bits_fingerprint"]
