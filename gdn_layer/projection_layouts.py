"""The two projection layouts of transformers' GatedDeltaNet blocks, and the ``load_state_dict`` pre-hook
that converts one into the other (a pure, exact reordering of weight rows)."""
from __future__ import annotations

import torch

_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_FUSED = ("in_proj_qkvz", "in_proj_ba")
# the input projections' module names of each layout (GatedDeltaNet's and transformers' blocks alike)
IN_PROJECTIONS = {"split": _SPLIT, "fused": _FUSED}


def load_either_layout(module, state_dict, prefix, *_):
    """``load_state_dict`` pre-hook: rewrite the other projection layout's weights into this layer's.

    A pure reordering of rows (exact): split ``in_proj_qkv [q_all | k_all | v_all]``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a`` (Qwen3.5) <-> fused ``in_proj_qkvz``, ``in_proj_ba`` in transformers'
    per-k-head grouped order, ``[q_h | k_h | v of its r heads | z of its r heads]`` and ``[b | a of its r
    heads]`` for each k head h (Qwen3-Next). Only a complete set of the other layout's weights with the
    expected shapes, and none of this layout's, is converted; anything else is left for
    ``load_state_dict`` to report as missing / unexpected / mismatched.
    """
    mine, other = (_SPLIT, _FUSED) if module.projection_layout == "split" else (_FUSED, _SPLIT)
    keys = [f"{prefix}{name}.weight" for name in other]
    if any(f"{prefix}{name}.weight" in state_dict for name in mine) or not all(k in state_dict for k in keys):
        return
    Hk, Dk, Dv, h = module.num_k_heads, module.head_k_dim, module.head_v_dim, module.hidden_size
    r = module.num_v_heads // Hk
    if module.projection_layout == "fused":
        qkv, z, b, a = (state_dict[k] for k in keys)
        want = [(2 * Hk * Dk + Hk * r * Dv, h), (Hk * r * Dv, h), (Hk * r, h), (Hk * r, h)]
        if [tuple(t.shape) for t in (qkv, z, b, a)] != want:
            return
        q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hk * r * Dv])
        new = {"in_proj_qkvz": torch.cat([q.reshape(Hk, Dk, h), k.reshape(Hk, Dk, h), v.reshape(Hk, r * Dv, h),
                                          z.reshape(Hk, r * Dv, h)], 1).reshape(-1, h),
               "in_proj_ba": torch.cat([b.reshape(Hk, r, h), a.reshape(Hk, r, h)], 1).reshape(-1, h)}
    else:
        qkvz, ba = (state_dict[k] for k in keys)
        if [tuple(t.shape) for t in (qkvz, ba)] != [(Hk * (2 * Dk + 2 * r * Dv), h), (2 * Hk * r, h)]:
            return
        q, k, v, z = qkvz.reshape(Hk, 2 * Dk + 2 * r * Dv, h).split([Dk, Dk, r * Dv, r * Dv], 1)
        b, a = ba.reshape(Hk, 2 * r, h).split([r, r], 1)
        new = {"in_proj_qkv": torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)]),
               "in_proj_z": z.reshape(-1, h), "in_proj_b": b.reshape(-1, h), "in_proj_a": a.reshape(-1, h)}
    for key in keys:
        del state_dict[key]
    state_dict.update({f"{prefix}{name}.weight": t for name, t in new.items()})


__all__ = ["load_either_layout"]
