"""The GatedDeltaNet block: a drop-in token mixer for Qwen3-Next / Qwen3.5-style hybrid models."""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.nn import functional as F

from gdn_layer import hf_blocks, kernels, mix_graphs
from gdn_layer.checks import check_config, check_inputs
from gdn_layer.context_parallel import cp_token_mix
from gdn_layer.derived import derived_from_sizes
from gdn_layer.in_projection import plain_linear, split_projections
from gdn_layer.kernels import (causal_conv1d, causal_conv1d_gate, chunk_gated_delta_rule, gdn_gate,
                               recurrent_gated_delta_rule)
from gdn_layer.kernels.registry import conv_fuses_l2norm
from gdn_layer.kernels.validation import skip_value_checks
from gdn_layer.norm import GatedRMSNorm
from gdn_layer.parallel import (gather_heads, head_to_seq, partition_heads, project_seq_to_head, resolve_sp_group,
                                seq_to_head)
from gdn_layer.pool import forward_pool, new_pool
from gdn_layer.projection_layouts import load_either_layout
from gdn_layer.state import GDNState, state_for_autograd
from gdn_layer.token_order import fragment_token_mix, to_held_order, to_original_order
from gdn_layer.submodules import conv_weight


def _is_decode(x: torch.Tensor, cu) -> bool:
    """At most one token per sequence (``B * T <= N``): the decode path (recurrent kernel, one conv)."""
    return x.shape[0] * x.shape[1] <= (x.shape[0] if cu is None else cu.numel() - 1)


class GatedDeltaNet(nn.Module):
    """Gated delta rule token mixer (Qwen3-Next / Qwen3.5 ``linear_attention`` block).

    For hidden states ``x [B, T, hidden]``::

        q, k [B,T,Hk,Dk], v, z [B,T,Hv,Dv], a, b [B,T,Hv]  = projections of x
        q, k, v = silu(causal depthwise conv over T of [q | k | v])       (kernel W, restarts per sequence)
        g = -exp(A_log) * softplus(a + dt_bias)   (fp32, <= 0)            beta = sigmoid(b)
        o = gated delta rule(l2norm(q) * Dk**-0.5, l2norm(k), v, g, beta)  value head j reads q/k head j // (Hv/Hk)
        y = out_proj(rmsnorm(o) * norm.weight * silu(z))                  [B, T, hidden]

    Math: Yang et al., "Gated Delta Networks" (ICLR 2025); block layout and parameter names as in
    transformers' ``Qwen3NextGatedDeltaNet`` (``projection_layout="fused"``) and
    ``Qwen3_5GatedDeltaNet`` (``"split"``), so their ``state_dict`` loads unchanged.

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: Hk q/k heads and Hv value heads, ``Hv % Hk == 0``.
        head_k_dim, head_v_dim: Dk, Dv.
        conv_kernel_size: W of the causal conv (default 4).
        norm_eps: epsilon of the gated RMSNorm.
        projection_layout: ``"split"`` (``in_proj_qkv, in_proj_z, in_proj_b, in_proj_a``) or ``"fused"``
            (``in_proj_qkvz, in_proj_ba`` in transformers' per-k-head grouped order).
        sp_group: Ulysses sequence-parallel group (ProcessGroup or 1-D DeviceMesh) or None. Under SP each
            rank passes its contiguous ``T/P`` slice of the packed sequence; see docs/ulysses.md.
        backend: kernel backend name or ``"auto"`` (``gdn_layer.kernels.available_backends()``).
        device, dtype: for the parameters.
        cp_group: state-passing context-parallel group (ProcessGroup or 1-D DeviceMesh) or None, alone or
            with ``sp_group`` on a C x P mesh: rank (c, s) passes slice ``c*P + s`` of ``C*P`` equal
            contiguous slices of the packed sequence (``B == 1``); see docs/context_parallel.md. The two
            groups may share only this rank (ValueError otherwise).

    Raises:
        TypeError / ValueError: bad sizes, ``Hv % Hk != 0``, an unknown ``projection_layout`` or backend,
            or head counts that the SP size cannot partition (names num_k_heads, num_v_heads, SP size).

    In a training stack (docs/layer.md): meta-device init then ``to_empty`` + ``reset_parameters()`` /
    ``load_state_dict`` works also under SP (no buffers); ``copy.deepcopy`` shares ``sp_group``;
    ``load_state_dict`` takes either projection layout's weights (converted exactly); fp64 parameters
    run every step in fp64.
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel_size: int = 4, norm_eps: float = 1e-6, projection_layout: str = "split",
                 sp_group=None, backend: str = "auto", device=None, dtype=None, cp_group=None):
        super().__init__()
        hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size = check_config(
            hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel_size, norm_eps,
            projection_layout, dtype)
        self.hidden_size, self.num_k_heads, self.num_v_heads = hidden_size, num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size, self.projection_layout = conv_kernel_size, projection_layout

        self.sp_group, self.sp_size, self.sp_rank = resolve_sp_group(sp_group)
        self.cp_group, self.cp_size, self.cp_rank = resolve_sp_group(cp_group, name="cp_group")
        if self.sp_size > 1 and self.cp_size > 1:
            import torch.distributed as dist
            shared = set(dist.get_process_group_ranks(self.sp_group)) & set(dist.get_process_group_ranks(self.cp_group))
            if shared != {dist.get_rank()}:
                raise ValueError("sp_group and cp_group must be two dimensions of one mesh (they share only this "
                                 f"rank), but they share global ranks {sorted(shared)}")
        self.heads = partition_heads(num_k_heads, num_v_heads, self.sp_size)
        self.backend = backend

        kw = {"device": device, "dtype": dtype}
        if projection_layout == "split":
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False, **kw)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False, **kw)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False, **kw)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False, **kw)
        else:
            self.in_proj_qkvz = nn.Linear(hidden_size, self.conv_dim + self.value_dim, bias=False, **kw)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **kw)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,
                                padding=conv_kernel_size - 1, bias=False, **kw)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **kw))
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, backend=self._backend, **kw)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **kw)
        self.local_conv_dim = 2 * self.heads.k_heads_per_rank * head_k_dim + self.heads.v_heads_per_rank * head_v_dim
        self._feature_index_cache: dict = {}
        self.register_load_state_dict_pre_hook(load_either_layout)
        self.reset_parameters()

    @classmethod
    def from_hf(cls, hf_module: nn.Module, sp_group=None, backend: str = "auto", cp_group=None) -> "GatedDeltaNet":
        """Build from a transformers GatedDeltaNet block (Qwen3-Next, Qwen3.5 and the families listed in
        ``gdn_layer/hf_blocks.py``), copying its weights exactly, each in its dtype, and checking the copy
        against the block on a small random input. OLMo-Hybrid blocks: ``gdn_layer.hf.from_hf``."""
        return hf_blocks.build(cls, hf_module, sp_group=sp_group, backend=backend, cp_group=cp_group)

    # construction helpers ------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The requested kernel backend (``"auto"`` or a name); ``resolved_backend`` gives the bound one."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"backend must be a string, got {type(name).__name__}")
        if name != "auto" and name not in kernels.available_backends():
            raise ValueError(f"backend must be 'auto' or one of {kernels.available_backends()}, got {name!r}")
        self._backend = name
        if hasattr(self, "norm"):
            self.norm.backend = name

    @property
    def resolved_backend(self) -> str:
        """The backend the kernels run with on the parameters' device (raises if it cannot run there)."""
        return kernels.resolve_backend(self._backend, self.A_log.device).name

    def reset_parameters(self, initializer_range: float = 0.02) -> None:
        """Initialise as transformers does for the same config: linear and conv weights ~ N(0, 0.02),
        ``dt_bias = 1``, ``A_log = log(U(0.01, 16))``, norm weight 1."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Conv1d)):
                    m.weight.normal_(0.0, initializer_range)
            self.dt_bias.fill_(1.0)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log_())
            self.norm.weight.fill_(1.0)

    @torch.compiler.disable
    def _feature_index(self, device: torch.device) -> torch.Tensor:
        """Per rank: which channels of ``[q_all | k_all | v_all | a | b]`` it owns after the all-to-all.

        int64 ``[P, C_local + 2 Hv_local]`` on ``device``, from the sizes alone, kept per device in a plain dict
        (``derived_from_sizes``: built outside inference mode), never a buffer (``to_empty`` after meta init
        would leave it uninitialised). Never traced by torch.compile (SP only; a new index tensor per traced
        call would defeat ``plan_for``'s cache).
        """
        def build():
            Dk, Dv, Hv = self.head_k_dim, self.head_v_dim, self.num_v_heads
            rows = []
            for rank in range(self.sp_size):
                kh = torch.tensor(list(self.heads.k_heads(rank)))
                vh = torch.tensor(list(self.heads.v_heads(rank)))
                qk_rows = (kh[:, None] * Dk + torch.arange(Dk)).reshape(-1)
                v_rows = (vh[:, None] * Dv + torch.arange(Dv)).reshape(-1)
                rows.append(torch.cat([qk_rows, self.key_dim + qk_rows, 2 * self.key_dim + v_rows,
                                       self.conv_dim + vh, self.conv_dim + Hv + vh]))
            return torch.stack(rows).to(device)
        return derived_from_sizes(self._feature_index_cache, (device.type, device.index), build)

    _graphed = None   # gdn_layer.graphed.GraphedCall on a layer captured by make_graphed_layers
    _fuses_decode = None   # None: the pool's fused step runs where _conv_gate / _delta_rule are these (pool.py)

    def __deepcopy__(self, memo):
        """A deep copy that shares the SP (and CP) process group (which cannot be copied or pickled): EMA and
        reference models are deep copies that run in the same group."""
        for group in (self.sp_group, self.cp_group):
            if group is not None:
                memo.setdefault(id(group), group)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    # ----------------------------------------------------------------------------------------------
    # forward: the dataflow, top to bottom

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                state: GDNState | None = None, output_state: bool = False, token_order: torch.Tensor | None = None,
                state_slots: torch.Tensor | None = None, checkpoint_slots: torch.Tensor | None = None,
                checkpoint_every: int = 1):
        """Mix tokens of ``hidden_states`` with the gated delta rule.

        Args:
            hidden_states: ``[B, T_local, hidden]``; without SP ``T_local == T``, under SP this rank's
                contiguous ``T/P`` slice of the (packed) sequence; with ``cp_group`` (C ranks) slice
                ``c*P + s`` of ``C*P`` (docs/context_parallel.md).
            cu_seqlens: ``[N + 1]`` int32/int64 GLOBAL boundaries of packed sequences (B == 1), the same on
                every rank; conv and recurrence restart at each boundary. None: B independent sequences.
            state: a ``GDNState`` to continue from (decode or chunked prefill): ``[N, ...]``, one row per
                sequence; always the full state (all heads), also under SP.
            output_state: also return the ``GDNState`` after the last token of each sequence.
            token_order: int64 ``[T]``, the same on every rank, or None (contiguous slices): the original
                position of each token in the order the ranks hold them, as PyTorch's CP load balancers
                rearrange (``gdn_layer.parallel.head_tail_order``); rank i of the cp x sp mesh (one process:
                rank 0 of 1) holds entries ``i*T/P .. (i+1)*T/P`` and gets its output at the same positions;
                ``cu_seqlens`` and ``state`` stay in the original order. Any permutation under SP alone; with
                ``cp_group`` at most ``2N + 2`` fragments per cp rank (gdn_layer/token_order.py).
            state_slots, checkpoint_slots, checkpoint_every: serve from a pool ``state = new_state(num_slots)``,
                rows read and written in place; inference only, one rank (gdn_layer/pool.py, docs/layer.md).

        Returns:
            ``y [B, T_local, hidden]`` in the activation dtype, or ``(y, GDNState)`` if ``output_state``.

        Raises:
            TypeError / ValueError naming the argument, before any kernel launch or collective (under SP,
            with value checks on, every rank raises together after one small all-reduce).
        """
        if state_slots is not None or checkpoint_slots is not None:   # serving: a state pool, rows in place
            return forward_pool(self, hidden_states, cu_seqlens, state, output_state, token_order, state_slots,
                                checkpoint_slots, checkpoint_every)
        graphed = self._graphed   # make_graphed_layers: a call of the captured capacity replays (gdn_layer/graphed.py)
        if graphed is not None and graphed.applies(self, hidden_states, cu_seqlens, state, output_state, token_order):
            return graphed(self, hidden_states, cu_seqlens)
        cu, held = check_inputs(self, hidden_states, cu_seqlens, state, output_state, token_order)
        state = state_for_autograd(state)
        if (y := mix_graphs.try_layer(self, hidden_states, cu, state, output_state, held)) is not None:
            return y   # the whole call from a replay (gdn_layer/mix_graphs.py; there also try_mix below)
        # pre-conv [q | k | v | a | b] of this rank's heads for every token (under SP the all-to-all is inside:
        # the projection writes its send buffer), the output gate z of the local tokens; with token_order, in
        # original order (gdn_layer/token_order.py)
        mixed, z = self._project(hidden_states)
        mixed = to_original_order(mixed, held)
        if (o := mix_graphs.try_mix(self, mixed, z, cu, state, output_state, held)) is not None:  # a replay
            return self.out_proj(o.flatten(2))
        with self._checked_already():
            if held is not None and held.fragments is not None:  # cp over fragments of the original order
                o, conv_state, recurrent_state = fragment_token_mix(self, mixed, state, output_state,
                                                                    held.fragments)
            elif self.cp_size > 1:  # this cp slice; states handed between slices
                o, conv_state, recurrent_state = cp_token_mix(self, mixed, cu, state, output_state)
            else:
                q, k, v, g, beta, conv_state = self._conv_gate(mixed, cu, self._local_conv_state(state),
                                                               output_state)
                o, recurrent_state = self._delta_rule(q, k, v, g, beta, cu, self._local_recurrent_state(state),
                                                      output_state)
        o = to_held_order(o, held)
        o = head_to_seq(o.flatten(2), self.sp_group) if self.sp_size > 1 else o.flatten(2)
        o = self.norm(o.unflatten(-1, (self.num_v_heads, self.head_v_dim)), z)
        y = self.out_proj(o.flatten(2))
        if not output_state:
            return y
        return y, self._full_state(conv_state, recurrent_state)

    def new_state(self, num_slots: int) -> GDNState:
        """A state pool of ``num_slots`` zero rows (float32; float64 for a float64 layer) on the layer's device,
        for ``forward(..., state=pool, state_slots=...)`` (gdn_layer/pool.py). Raises TypeError / ValueError:
        ``num_slots`` not a positive int."""
        return new_pool(self, num_slots)

    # ----------------------------------------------------------------------------------------------
    # forward helpers

    def _checked_already(self):
        """Under SP the inputs were checked (and agreed on) before the all-to-all; value checks inside
        the kernels would see only this rank's heads and could raise on one rank alone, leaving the
        others waiting in the all-to-all back. A NaN that arises from the weights propagates instead."""
        return skip_value_checks() if self.sp_size * self.cp_size > 1 else contextlib.nullcontext()

    def _project(self, x):
        """``x [B, T_local, hidden]`` -> ``mixed [B, T, C_local + 2 hv]``, the pre-conv
        ``[q | k | v | a | b]`` of this rank's heads for every token (``T = T_local``, all heads without
        SP; after the Ulysses all-to-all under SP), and ``z [B, T_local, Hv, Dv]``."""
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.projection_layout == "split":
            parts = (self.in_proj_qkv, self.in_proj_a, self.in_proj_b)
            as_z = lambda t: t.reshape(*x.shape[:2], Hv, Dv)   # noqa: E731
            if all(plain_linear(m) for m in parts) and len({(m.weight.dtype, m.weight.device) for m in parts}) == 1:
                # one GEMM on the weights' concatenation into [qkv | a | b], under SP into the all-to-all's send
                # buffer (project_seq_to_head); x's input gradients summed in GEMMs (in_projection.py)
                if self.sp_size == 1 and plain_linear(self.in_proj_z):
                    mixed, z = split_projections(x, *(m.weight for m in (*parts, self.in_proj_z)))
                    return mixed, as_z(z)
                weight = torch.cat([m.weight for m in parts])
                if self.sp_size > 1:
                    return project_seq_to_head(x, weight, self._feature_index(x.device), self.sp_group), \
                        as_z(self.in_proj_z(x))
                return F.linear(x, weight), as_z(self.in_proj_z(x))
            z = as_z(self.in_proj_z(x))
            qkv, a, b = (m(x) for m in parts)   # wrapped projections (LoRA, hooks, quantized): call them
        else:
            # transformers' fused order: per k head [q (Dk) | k (Dk) | v (r Dv) | z (r Dv)], [b (r) | a (r)]
            r = Hv // Hk
            qkvz = self.in_proj_qkvz(x).unflatten(-1, (Hk, 2 * Dk + 2 * r * Dv))
            q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
            b, a = self.in_proj_ba(x).unflatten(-1, (Hk, 2 * r)).split([r, r], dim=-1)
            qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
            b, a = b.flatten(2), a.flatten(2)
            z = z.reshape(*x.shape[:2], Hv, Dv)
        mixed = torch.cat([qkv, a, b], -1)
        if self.sp_size > 1:
            mixed = seq_to_head(mixed, self._feature_index(mixed.device), self.sp_group)
        return mixed, z

    def _v_head_index(self, device: torch.device) -> list[torch.Tensor]:
        """Per rank, int64 ``[Hv_local]`` on ``device``: the value heads it holds. Kept like
        ``_feature_index`` (from the sizes alone), so a state gather copies no index to the device."""
        return derived_from_sizes(self._feature_index_cache, ("v_heads", device.type, device.index), lambda: [
            torch.arange(r.start, r.stop, device=device) for r in map(self.heads.v_heads, range(self.sp_size))])

    def _local_conv_state(self, state: GDNState | None):
        """This rank's channels of a full conv state (those of its q/k and value heads)."""
        if state is None or self.sp_size == 1:
            return None if state is None else state.conv_state
        index = self._feature_index(state.conv_state.device)
        return state.conv_state.index_select(1, index[self.sp_rank, :self.local_conv_dim])

    def _local_recurrent_state(self, state: GDNState | None):
        """This rank's value heads of a full recurrent state."""
        if state is None or self.sp_size == 1:
            return None if state is None else state.recurrent_state
        vh = self.heads.v_heads(self.sp_rank)
        return state.recurrent_state[:, vh.start:vh.stop]

    def _conv_gate(self, mixed, cu, initial_state, output_state, params=None):
        """Causal conv + SiLU over the full T on this rank's channels, from ``initial_state`` (this rank's
        channels, or None), and the gate ``g = -exp(A_log) softplus(a + dt_bias)`` (fp32, fp64 for fp64
        weights), ``beta = sigmoid(b)`` of this rank's heads: ``(q, k, v, g, beta, conv_state)``. ``params``:
        ``(conv weight [C, W], A_log, dt_bias)`` to use instead of the layer's (the mix graphs' copies)."""
        C = self.local_conv_dim
        Dk, Dv = self.head_k_dim, self.head_v_dim
        hk, hv = self.heads.k_heads_per_rank, self.heads.v_heads_per_rank
        # [C, 1, W] -> [C, W] as a view (honours an accelerate hook on conv1d): a select or slice here would
        # cost a zero-filled [C, W] gradient and a copy each in the backward
        weight, A_log, dt_bias = params or (conv_weight(self.conv1d).squeeze(1), self.A_log, self.dt_bias)
        if self.sp_size > 1:   # (without SP no slice: its backward would zero-fill and copy a gradient)
            weight = weight.index_select(0, self._feature_index(weight.device)[self.sp_rank, :C])
            vh = self.heads.v_heads(self.sp_rank)
            A_log, dt_bias = A_log[vh.start:vh.stop], dt_bias[vh.start:vh.stop]
        widths = [hk * Dk, hk * Dk, hv * Dv]
        if not _is_decode(mixed, cu):
            # training / prefill: one op reads q, k, v, a and b in place from mixed and writes q, k, v as three
            # contiguous tensors (which the chunk kernels take as they are); its backward writes the whole
            # gradient of mixed as one buffer, each kernel its own columns (kernels/api.py, causal_conv1d_gate)
            # (on a backend whose conv fuses it, q and k come L2-normalised: _qk_l2norm_in_conv)
            (q, k, v), g, beta, conv_state = causal_conv1d_gate(
                mixed, weight, A_log, dt_bias, widths, cu_seqlens=cu, initial_state=initial_state,
                output_final_state=output_state, backend=self._backend,
                l2norm_head_dim=Dk if self._qk_l2norm_in_conv(mixed, cu) else None)
        else:
            # decode (one token per sequence): one conv launch for all channels
            x, a, b = mixed.split([C, hv, hv], -1)
            qkv, conv_state = causal_conv1d(x, weight, None, cu_seqlens=cu, initial_state=initial_state,
                                            output_final_state=output_state, backend=self._backend)
            q, k, v = qkv.split(widths, -1)
            g, beta = gdn_gate(a, b, A_log, dt_bias, backend=self._backend)
        return (q.unflatten(-1, (hk, Dk)), k.unflatten(-1, (hk, Dk)), v.unflatten(-1, (hv, Dv)),
                g, beta, conv_state)

    def _delta_rule(self, q, k, v, g, beta, cu, initial_state, output_state):
        """Recurrent kernel when every sequence has at most one token (decode), chunk kernel otherwise;
        ``initial_state`` has this rank's value heads (or is None)."""
        kernel = recurrent_gated_delta_rule if _is_decode(q, cu) else chunk_gated_delta_rule
        return kernel(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_state, cu_seqlens=cu,
                      use_qk_l2norm=not self._qk_l2norm_in_conv(q, cu), backend=self._backend)

    def _qk_l2norm_in_conv(self, x, cu) -> bool:
        """Whether ``_conv_gate`` returns q and k L2-normalised (training / prefill on a backend whose conv
        kernels fuse the norm, ``registry.conv_fuses_l2norm``; saves the norm's two kernels per call and its
        backward's), so that the delta rule runs with ``use_qk_l2norm=False``; else the delta rule normalises.
        From the shapes (``x``: mixed or q) and the backend alone, so the conv and every delta-rule call on its
        q and k (``_delta_rule``, the CP maps) agree."""
        return not _is_decode(x, cu) and conv_fuses_l2norm(self._backend, x.device)

    def _full_state(self, conv_state, recurrent_state) -> GDNState:
        """Under SP, gather every rank's heads into the full state (transformers' channel order)."""
        if self.sp_size > 1:
            idx = self._feature_index(conv_state.device)[:, :self.local_conv_dim]
            conv_state = gather_heads(conv_state, list(idx), self.conv_dim, 1, self.sp_group)
            recurrent_state = gather_heads(recurrent_state, self._v_head_index(recurrent_state.device),
                                           self.num_v_heads, 1, self.sp_group)
        return GDNState(conv_state.float() if conv_state.dtype != torch.float64 else conv_state,
                        recurrent_state)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_k_heads={self.num_k_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, layout={self.projection_layout!r}, "
                f"sp_size={self.sp_size}, cp_size={self.cp_size}, backend={self._backend!r}")
