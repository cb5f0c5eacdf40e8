"""Public entry points: validate once (shared by every backend), then dispatch to the bound backend."""
from __future__ import annotations

from . import ops_conv, ops_conv_gate, ops_delta_rule, ops_gate, ops_norm
from .registry import backend_name
from .validation import (check_conv_inputs, check_flags, check_float_tensors, check_gated_delta_inputs,
                         check_l2norm_head_dim, check_scale, check_split_sizes)


def _activation(activation) -> str:
    """The conv ops' activation name (validated before): "silu" for "silu" / "swish", else "identity"."""
    return "silu" if activation in ("silu", "swish") else "identity"


def _scale(scale, q) -> float:
    return float(q.shape[-1] ** -0.5 if scale is None else scale)


def _delta_rule(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, backend):
    """The checks of ``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``, then ``op``, their operator."""
    check_flags(output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
    check_scale(scale)
    _, _, cu = check_gated_delta_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    name = backend_name(backend, q.device)
    o, final = op(q, k, v, g, beta, initial_state, cu, _scale(scale, q), output_final_state, use_qk_l2norm, name)
    return o, (final if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm=False, backend="auto"):
    """Gated delta rule over whole sequences, chunked (chunk size 64).

    Args:
        q, k: ``[B, T, Hk, Dk]``. v: ``[B, T, Hv, Dv]`` with ``Hv % Hk == 0``; value head j reads q/k
            head ``j // (Hv / Hk)`` (grouped value attention; q/k are never repeated).
        g: ``[B, T, Hv]`` log-space decay, ``g <= 0``, ``-inf`` is a full reset. beta: ``[B, T, Hv]``.
        scale: multiplies q; default ``Dk ** -0.5``.
        initial_state: ``[N, Hv, Dk, Dv]`` float32 (float64 for float64 inputs); N = B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: also return the state after each sequence, ``[N, Hv, Dk, Dv]``.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences (requires B == 1); the state
            restarts (from ``initial_state[n]``) at each boundary.
        use_qk_l2norm: L2-normalise q and k over Dk in fp32 before use (``x * rsqrt(sum x^2 + 1e-6)``).
        backend: ``"auto"`` or a registered name (``gdn_layer.kernels.available_backends()``).

    Returns:
        ``(o, final_state)``: o ``[B, T, Hv, Dv]`` in v's dtype; final_state or None.

    Raises:
        TypeError / ValueError naming the argument, before any kernel runs (see ``validation``).

    Math: Yang et al., "Gated Delta Networks" (ICLR 2025); chunked form as in fla's ``chunk_gated_delta_rule``.
    """
    return _delta_rule(ops_delta_rule.chunk_gated_delta_rule_op, q, k, v, g, beta, scale, initial_state,
                       output_final_state, cu_seqlens, use_qk_l2norm, backend)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm=False, backend="auto"):
    """Gated delta rule token by token; same arguments, shapes and errors as ``chunk_gated_delta_rule``.

    Meant for decoding (one or a few tokens per sequence); the float64 torch version is the ground
    truth of the tests.
    """
    return _delta_rule(ops_delta_rule.recurrent_gated_delta_rule_op, q, k, v, g, beta, scale, initial_state,
                       output_final_state, cu_seqlens, use_qk_l2norm, backend)


def causal_conv1d(x, weight, bias=None, activation="silu", cu_seqlens=None, initial_state=None,
                  output_final_state=False, backend="auto"):
    """Depthwise causal 1-D convolution (+ SiLU) that restarts at every packed-sequence boundary.

    Args:
        x: ``[B, T, C]``. weight: ``[C, W]`` (nn.Conv1d's ``[C, 1, W]`` squeezed). bias: ``[C]`` or None.
        activation: ``"silu"`` (alias ``"swish"``) or None / ``"identity"``.
        cu_seqlens: ``[N + 1]`` boundaries (B == 1); no token sees another sequence's inputs.
        initial_state: ``[N, C, W - 1]``: the W-1 inputs that precede each sequence (zeros if None).
        output_final_state: also return the last W-1 inputs of each sequence, ``[N, C, W - 1]``.

    Returns:
        ``(y, final_state)``: y ``[B, T, C]`` in x's dtype; final_state (fp32, or float64) or None.
    """
    check_flags(output_final_state=output_final_state)
    _, cu = check_conv_inputs(x, weight, bias, initial_state, cu_seqlens, activation)
    name = backend_name(backend, x.device)
    y, final = ops_conv.causal_conv1d_op(x, weight, bias, initial_state, cu, _activation(activation),
                                         output_final_state, name)
    return y, (final if output_final_state else None)


def causal_conv1d_split(x, weight, split_sizes, bias=None, activation="silu", cu_seqlens=None, initial_state=None,
                        output_final_state=False, backend="auto"):
    """``causal_conv1d`` with its output in parts: ``y.split(split_sizes, -1)``, each part contiguous.

    For the layer's q, k and v: one conv call instead of one per part, and no copy to make the column
    slices contiguous. On a backend with ``conv_splits`` one launch per pass, forward and backward;
    on the others one conv per part inside the call (the layer then calls ``causal_conv1d`` per part
    itself: docs/kernels.md).

    Args:
        split_sizes: 1 to 3 non-negative ints summing to C = ``x.shape[-1]``.
        The rest: as ``causal_conv1d``.

    Returns:
        ``(ys, final_state)``: ys a list of ``[B, T, size]`` contiguous tensors in x's dtype, one per
        entry of ``split_sizes``; final_state ``[N, C, W - 1]`` (fp32, or float64) or None.

    Raises:
        TypeError / ValueError naming the argument (``causal_conv1d``'s checks, and ``split_sizes``).
    """
    check_flags(output_final_state=output_final_state)
    _, cu = check_conv_inputs(x, weight, bias, initial_state, cu_seqlens, activation)
    sizes = check_split_sizes(split_sizes, x.shape[-1])
    name = backend_name(backend, x.device)
    *ys, final = ops_conv.causal_conv1d_split_op(x, weight, bias, initial_state, cu, sizes, _activation(activation),
                                                 output_final_state, name)
    return ys[:len(split_sizes)], (final if output_final_state else None)


def gated_rms_norm(x, z, weight, eps=1e-6, backend="auto"):
    """``weight * rmsnorm(x) * silu(z)`` over the last dim (Qwen3-Next's gated RMSNorm).

    x, z: ``[..., Dv]`` same shape; weight ``[Dv]``. Returns x's dtype.
    """
    check_float_tensors(x=x, z=z, weight=weight)
    if x.shape != z.shape:
        raise ValueError(f"x and z must have the same shape, got {tuple(x.shape)} and {tuple(z.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    return ops_norm.gated_rms_norm_op(x, z, weight, float(eps), backend_name(backend, x.device))


def gdn_gate(a, b, A_log, dt_bias, backend="auto"):
    """The gate of the GatedDeltaNet block: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

    Args:
        a, b: ``[B, T, H]`` floating (any strides: views into a wider buffer are read in place).
        A_log, dt_bias: ``[H]``.

    Returns:
        ``(g, beta)``: g ``[B, T, H]`` fp32 (float64 when any input is float64), ``<= 0``;
        beta ``[B, T, H]`` in b's dtype.

    Raises:
        TypeError / ValueError naming the argument (non-tensors, non-floating dtypes, shapes, devices).
    """
    check_float_tensors(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    if a.dim() != 3 or a.shape != b.shape:
        raise ValueError(f"a and b must be [B, T, H] of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(t.shape) != (a.shape[-1],):
            raise ValueError(f"{name} must be [H] = [{a.shape[-1]}], got {tuple(t.shape)}")
    return ops_gate.gdn_gate_op(a, b, A_log, dt_bias, backend_name(backend, a.device))


def causal_conv1d_gate(mixed, weight, A_log, dt_bias, split_sizes, activation="silu", cu_seqlens=None,
                       initial_state=None, output_final_state=False, backend="auto", l2norm_head_dim=None):
    """The layer's conv and gate from its pre-conv buffer ``[x | a | b]``, as one differentiable op:
    ``causal_conv1d_split(x, weight, split_sizes, ...)`` (no bias) and ``gdn_gate(a, b, A_log, dt_bias)``;
    with ``l2norm_head_dim`` also the gated delta rule's q / k norm of the first two parts.

    Its backward returns the gradient of ``mixed`` as one buffer: on a backend with ``grads_into`` (the
    CUDA and Ascend ones) the conv's dx passes and the gate's backward write their own columns of it, so no
    ``[dx | da | db]`` concatenation runs (docs/kernels.md, "Conv and gate as one op").

    Args:
        mixed: ``[B, T, C + 2H]`` with C = ``sum(split_sizes)`` and H = ``A_log.shape[0]``: the conv's input
            x, then a, then b (any strides on B and T; read in place).
        weight: ``[C, W]``. A_log, dt_bias: ``[H]``.
        split_sizes, activation, cu_seqlens (``[N + 1]``, requires B == 1), initial_state (``[N, C, W - 1]``),
            output_final_state, backend: as ``causal_conv1d_split``. No conv bias: for a conv with bias call
            ``causal_conv1d_split`` and ``gdn_gate``.
        l2norm_head_dim: None, or a positive int D dividing ``split_sizes[0]`` and ``split_sizes[1]``: those two
            parts (q and k; with fewer parts, those there are) are L2-normalised over each head of D channels
            after the activation, ``y / sqrt(sum_head y^2 + 1e-6)`` (fla's ``l2norm``; then pass
            ``use_qk_l2norm=False`` to the delta rule). Inside the conv kernels on a backend with ``conv_l2norm`` (the CUDA ones:
            ``registry.conv_fuses_l2norm``), in torch after the conv elsewhere; either way the backward goes
            through the norm from the normalised q, k and their saved factors ``rstd`` (no recompute).

    Returns:
        ``(ys, g, beta, final_state)``: ys a list of contiguous ``[B, T, size]`` in mixed's dtype, one per
        entry of ``split_sizes``; g ``[B, T, H]`` fp32 (float64 when mixed, A_log or dt_bias is float64);
        beta ``[B, T, H]`` in mixed's dtype; final_state ``[N, C, W - 1]`` fp32 (float64 when mixed, weight or
        initial_state is float64) or None.

    Raises:
        TypeError / ValueError naming the argument: ``causal_conv1d_split``'s and ``gdn_gate``'s checks,
        ``mixed``'s width against ``split_sizes`` and H, and ``l2norm_head_dim`` (an int dividing q's and k's
        widths).
    """
    check_flags(output_final_state=output_final_state)
    check_float_tensors(mixed=mixed, weight=weight, A_log=A_log, dt_bias=dt_bias)
    if mixed.dim() != 3:
        raise ValueError(f"mixed must be [B, T, C + 2H], got shape {tuple(mixed.shape)}")
    if A_log.dim() != 1 or A_log.shape[0] == 0:
        raise ValueError(f"A_log must be [H] with H >= 1, got {tuple(A_log.shape)}")
    if dt_bias.shape != A_log.shape:
        raise ValueError(f"dt_bias must be [H] like A_log, [{A_log.shape[0]}], got {tuple(dt_bias.shape)}")
    H = A_log.shape[0]
    C = mixed.shape[-1] - 2 * H
    sizes = check_split_sizes(split_sizes, C,
                              what=f"mixed.shape[-1] - 2 * A_log.shape[0] = {mixed.shape[-1]} - 2 * {H}")
    # (the gate's inputs are checked above: a and b are mixed's last 2H columns)
    _, cu = check_conv_inputs(mixed[..., :C], weight, None, initial_state, cu_seqlens, activation,
                              x_name="mixed[..., :C]")
    l2norm_dim = check_l2norm_head_dim(l2norm_head_dim, split_sizes)
    name = backend_name(backend, mixed.device)
    *ys, g, beta, final, _, _ = ops_conv_gate.conv_gate_op(mixed, weight, A_log, dt_bias, initial_state, cu, sizes,
                                                           _activation(activation), output_final_state, l2norm_dim,
                                                           name)
    return ys[:len(split_sizes)], g, beta, (final if output_final_state else None)


def pool_decode_step(*args, **kwargs):
    """The state pool's fused decode step: one token per sequence, the pool rows updated in place (arguments,
    shapes and dtypes: ``decode_step`` in kernels/triton/decode.py). Imported on first use, so that the layer's
    package reaches the Triton kernels only through this one."""
    from .triton.decode import decode_step
    return decode_step(*args, **kwargs)
