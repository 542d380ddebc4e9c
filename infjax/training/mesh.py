"""The device mesh and the shardings of the batch and the state."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")     # the batch's leading dimension is split over both


def make_mesh(mesh_config, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh from `config.mesh`; data=-1 takes the remaining devices.

    Axis types are Auto so that sharding propagation inserts the collectives
    (e.g. the all-gather behind iq @ p.T with both operands split on data).
    """
    devices = list(devices if devices is not None else jax.devices())
    fsdp, tensor = mesh_config.fsdp, mesh_config.tensor
    data = len(devices) // (fsdp * tensor) if mesh_config.data == -1 else mesh_config.data
    n = data * fsdp * tensor
    if n < 1 or n > len(devices):
        raise ValueError(f"config.mesh (data={mesh_config.data}, fsdp={fsdp}, tensor={tensor}) needs {n} devices, "
                         f"{len(devices)} available")
    grid = np.asarray(devices[:n]).reshape(data, fsdp, tensor)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Global arrays from this process's slice of the batch (leading dim split over BATCH_AXES)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
