"""The device mesh and the shardings of the batch and the state."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from infjax.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")     # the batch's leading dimension is split over both


def mesh_shape(mesh_config, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes; at most one axis is -1 and takes the remaining devices."""
    sizes = [int(mesh_config[a]) for a in AXES]
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1 or any(s < 1 and s != -1 for s in sizes):
        raise ConfigError(f"config.mesh {dict(zip(AXES, sizes))}: sizes must be >= 1, at most one -1")
    if free:
        rest = int(np.prod([s for s in sizes if s != -1]))
        sizes[free[0]] = max(num_devices // rest, 1)
    return tuple(sizes)


def make_mesh(mesh_config, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh from `config.mesh` (or a dict of the three sizes).

    An axis of -1 takes the remaining devices.

    `jax.make_mesh` orders the devices by the physical topology (TPU torus, GPU NVLink islands), so that the innermost
    axes land on the best-connected devices. Axis types are Auto so that sharding propagation inserts the collectives
    (e.g. the all-gather behind iq @ p.T with both operands split on data).
    """
    devices = list(devices if devices is not None else jax.devices())
    data, fsdp, tensor = mesh_shape(mesh_config, len(devices))
    n = data * fsdp * tensor
    if n < 1 or n > len(devices):
        raise ConfigError(f"config.mesh (data={mesh_config['data']}, fsdp={mesh_config['fsdp']}, "
                         f"tensor={mesh_config['tensor']}) needs {n} devices, {len(devices)} available")
    return jax.make_mesh((data, fsdp, tensor), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices[:n])


def default_mesh() -> Mesh:
    """Every device on the data axis: the mesh of evaluation and export when no config names one."""
    return make_mesh({"data": -1, "fsdp": 1, "tensor": 1})


def batch_shards(mesh: Mesh) -> int:
    """How many pieces the batch's leading dimension is split into."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def round_to_shards(rows: int, mesh: Mesh) -> int:
    """`rows` rounded up to a multiple of the batch shards (a batch the mesh can split evenly)."""
    shards = batch_shards(mesh)
    return -(-rows // shards) * shards


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(local: dict, mesh: Mesh) -> dict:
    """Global arrays from this process's slice of the batch, a tree of arrays (leading dim split over BATCH_AXES)."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(sharding, v), local)


def from_host(x, sharding) -> jax.Array:
    """A global array with `sharding` from a value that every process holds whole.

    The value is a numpy array, a scalar, or a jax.Array. Each process fills only its own devices' shards, so this is
    how any host value enters a jitted function on a multi-process mesh (jit refuses numpy inputs with a non-replicated
    sharding there). Always a new array (callers may donate it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put(tree, shardings):
    """`from_host` over a tree: `shardings` is a matching tree, or one sharding for every leaf."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: from_host(x, shardings), tree)
    return jax.tree.map(from_host, tree, shardings)
