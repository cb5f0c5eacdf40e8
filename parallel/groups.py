"""Turn the ``sp_group`` a user hands the layer into a process group, its size and this rank.

The layer takes its sequence-parallel group as data (a ``ProcessGroup`` or one dimension of a
``DeviceMesh``, e.g. ``mesh["sp"]``), never from a global, so SP composes with whatever data/tensor
parallelism the caller builds around it.
"""
from __future__ import annotations

import torch.distributed as dist


def resolve_sp_group(sp_group, name: str = "sp_group") -> tuple["dist.ProcessGroup | None", int, int]:
    """Return ``(group, size, rank)`` for a sequence-parallel group given as data.

    Args:
        sp_group: ``None`` (no sequence parallelism), a ``torch.distributed.ProcessGroup``, or a 1-D
            ``torch.distributed.device_mesh.DeviceMesh`` (e.g. ``mesh["sp"]``), whose process group is
            used.
        name: the argument's name in error messages (e.g. ``"cp_group"``).

    Returns:
        ``(None, 1, 0)`` for ``None``; otherwise ``(group, group size, this process's rank in the group)``.

    Raises:
        TypeError: ``sp_group`` is of any other type (this includes the placeholder that
            ``dist.new_group`` returns on processes outside the new group).
        ValueError: ``sp_group`` is a DeviceMesh with more than one dimension (pick one: ``mesh["sp"]``).

    Does no collective: safe to call on one rank alone, e.g. in a constructor.
    """
    if sp_group is None:
        return None, 1, 0
    if not dist.is_available():
        raise TypeError(f"{name} must be None on a torch build without torch.distributed, "
                        f"got {type(sp_group).__name__}")
    from torch.distributed.device_mesh import DeviceMesh  # import here: only needed with SP

    if isinstance(sp_group, DeviceMesh):
        if sp_group.ndim != 1:
            raise ValueError(f"{name} as a DeviceMesh must be 1-D (pass one dimension, e.g. mesh['sp']), "
                             f"got a {sp_group.ndim}-D mesh with dimension names {sp_group.mesh_dim_names}")
        group = sp_group.get_group()
    elif isinstance(sp_group, dist.ProcessGroup):
        group = sp_group
    else:
        raise TypeError(f"{name} must be None, a torch.distributed.ProcessGroup or a 1-D DeviceMesh, "
                        f"got {type(sp_group).__name__} ({sp_group!r})")
    # ProcessGroup.size()/rank() read local metadata only; dist.get_rank(group) would need the
    # default group to be initialised, which a caller using only explicit groups may not have.
    return group, int(group.size()), int(group.rank())


__all__ = ["resolve_sp_group"]
