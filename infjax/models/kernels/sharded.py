"""Run a per-device attention kernel on each device's own rows under a sharded step: `jax.shard_map`.

A Pallas kernel (GPU flash, TPU splash) is one opaque call to XLA's partitioner, which would gather the
whole batch onto every device to run it. Wrapped in `shard_map` over the mesh axes that split the rows
(and, where the heads divide evenly, the ``tensor`` axis over the heads), each device runs it on its own
block; nothing is gathered.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

TENSOR_AXIS = "tensor"


def _size(mesh, axes) -> int:
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[a] for a in names]))


def specs(sharding: NamedSharding | None, rows: int, heads: tuple[int, ...]) -> tuple[P, P] | str | None:
    """(row spec, [B, T, N, D] spec) of the per-device blocks under `sharding`; None or a reason where none apply.

    `sharding` is that of the [B, T, H] activations: its first entry names the batch axes. None where there is nothing
    to split (no sharding, one device); a reason (str) where the rows cannot be split evenly. `heads`: the head counts
    of the operands (query and key/value heads), split over ``tensor`` only if each is a multiple of it."""
    if sharding is None or not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return None
    spec = tuple(sharding.spec)
    batch = spec[0] if spec else None
    mesh = sharding.mesh
    if rows % _size(mesh, batch):
        return f"{rows} rows do not split evenly over the {_size(mesh, batch)} batch shards"
    tensor = mesh.shape.get(TENSOR_AXIS, 1)
    head = TENSOR_AXIS if tensor > 1 and all(n % tensor == 0 for n in heads) else None
    if batch is None and head is None:
        return None
    return P(batch, None), P(batch, None, head, None)


def per_shard(fn: Callable, sharding: NamedSharding | None, q, k, v, segment_ids, *extra) -> jax.Array:
    """`fn(q, k, v, segment_ids, *extra)` run on each device's block (see `specs`).

    Shapes: q [B, T, N, D], k/v [B, T, K, D], segment_ids [B, T] -> [B, T, N, D]; `extra`: arrays every device gets
    whole, e.g. a traced window. A reason string from `specs` must have been handled by the caller."""
    found = specs(sharding, q.shape[0], (q.shape[2], k.shape[2]))
    if found is None:
        return fn(q, k, v, segment_ids, *extra)
    assert not isinstance(found, str), found
    rows, blocks = found
    return jax.shard_map(fn, mesh=sharding.mesh, in_specs=(blocks, blocks, blocks, rows) + (P(),) * len(extra),
                         out_specs=blocks, check_vma=False)(q, k, v, segment_ids, *extra)
