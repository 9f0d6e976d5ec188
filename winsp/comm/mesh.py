"""A ``DeviceMesh`` as winsp's SP group: the one place where a mesh (or one named dimension of it) becomes the
process group that :class:`~winsp.comm.group.SPGroup` wraps.

Every winsp entry point that takes an SP group (``winsp.parallelize(group=)``, ``WindowRuntime(group=)``,
``model.build_runtime(group=)``, ``DiffusionParallelConfig(mesh=)``, ``winsp.sync_gradients``) goes through
:class:`SPGroup`, and :class:`SPGroup` goes through :func:`sp_process_group`. So a 1-D mesh, or ``mesh["sp"]`` of a
larger (dp, sp) mesh, works everywhere a process group does. A mesh with more than one dimension is refused, naming
its dimensions, because winsp cannot guess which of them is the window-SP one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_device_mesh", "sp_process_group", "mesh_size", "world_mesh"]


def is_device_mesh(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.device_mesh.DeviceMesh`` (False where torch.distributed is absent)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch build without distributed support
        return False
    return isinstance(value, DeviceMesh)


def _check_one_dimension(mesh) -> None:
    if mesh.ndim == 1:
        return
    names = mesh.mesh_dim_names
    shape = tuple(mesh.shape)
    if names:
        pick = " or ".join(f"mesh[{n!r}]" for n in names)
        raise ValueError(f"the SP group was given as a {mesh.ndim}-D DeviceMesh of shape {shape} with dimensions "
                         f"{tuple(names)}; winsp needs the one dimension whose ranks share windows: pass {pick}")
    raise ValueError(f"the SP group was given as a {mesh.ndim}-D DeviceMesh of shape {shape} without dimension "
                     f"names; build it with mesh_dim_names (e.g. init_device_mesh(..., mesh_dim_names=('dp', 'sp'))) "
                     f"and pass mesh['sp']")


def sp_process_group(group: Any):
    """The ``torch.distributed`` process group that ``group`` names.

    ``group``: a 1-D ``DeviceMesh`` (e.g. ``mesh["sp"]`` of a (dp, sp) mesh: this rank's SP dimension), a process
    group (returned as is), or None (returned as is: one rank). Anything else, and a mesh of several dimensions, is
    refused with a message saying what to pass.
    """
    if group is None:
        return None
    if is_device_mesh(group):
        _check_one_dimension(group)
        if group.get_coordinate() is None:
            raise ValueError(f"this process is not a member of the SP DeviceMesh it was given (ranks "
                             f"{group.mesh.flatten().tolist()})")
        return group.get_group()
    from torch.distributed import GroupMember, ProcessGroup

    if isinstance(group, int) and group == GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this process is not a member of the SP process group it was given")
    if not isinstance(group, ProcessGroup):
        raise ValueError(f"the SP group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh (or mesh['sp']), "
                         f"a winsp SPGroup or None, got {type(group).__name__}")
    return group


def mesh_size(mesh: Any) -> int:
    """The number of ranks of a 1-D ``DeviceMesh`` (checked as :func:`sp_process_group` checks it)."""
    if not is_device_mesh(mesh):
        raise ValueError(f"expected a 1-D torch.distributed DeviceMesh (e.g. mesh['sp']), got {type(mesh).__name__}")
    _check_one_dimension(mesh)
    return int(mesh.size())


def world_mesh(mesh: Any):
    """A 1-D ``DeviceMesh`` over every rank of ``mesh``: the mesh itself when it has one dimension, else its
    dimensions flattened into one (what FSDP2 shards over when every rank, SP ranks included, holds a shard).

    A sub-mesh such as ``mesh["sp"]`` is used as given: pass the whole mesh to shard over all of its ranks.
    """
    if not is_device_mesh(mesh):
        raise ValueError(f"expected a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    name = "_".join(names) if names else None
    try:
        return mesh._flatten(name) if name else mesh._flatten()
    except Exception as error:  # noqa: BLE001 - a private torch API: say what to do instead of a deep trace
        raise ValueError(f"cannot flatten the {mesh.ndim}-D DeviceMesh of shape {tuple(mesh.shape)} into one "
                         f"dimension ({type(error).__name__}: {error}); pass a 1-D mesh over all ranks "
                         f"instead") from error
