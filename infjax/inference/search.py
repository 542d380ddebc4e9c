"""Exact maximum-inner-product search: blocked matrix products with a running top-k, in JAX.

The corpus embeddings stay on the host (a numpy array or a memory map) and
stream through the devices one block at a time, so a corpus larger than
device memory can be searched. Each block is split over the mesh's batch
axes; every device scores its slice against all queries, keeps its own
top-k (`jax.lax.top_k`), the per-device candidates are gathered and cut to
k, and that is merged with the running top-k of the earlier blocks. Scores
are float32 (`preferred_element_type`) whatever the embedding dtype.

Ties: candidates are always concatenated in corpus order and `top_k` keeps
the lower index first among equal values (XLA's top-k is stable on CPU), so
the result equals a stable descending argsort on CPU; on GPU/TPU ties exactly
at the k-th place may resolve differently.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from infjax.runtime.mesh import BATCH_AXES, batch_shards, default_mesh, from_host, replicated, round_to_shards


def _block_topk_fn(mesh: Mesh, block_size: int, k_local: int, k: int) -> Callable:
    """jitted (queries [Q, d], block [B, d], n_valid, offset, best_v [Q, k], best_i [Q, k]) -> merged top-k."""
    local = block_size // batch_shards(mesh)

    def per_device(q, block, n_valid, offset):
        shard = jax.lax.axis_index(BATCH_AXES)
        s = jnp.einsum("qd,nd->qn", q, block, preferred_element_type=jnp.float32)
        pos = shard * local + jnp.arange(local)                       # position inside the block
        s = jnp.where(pos[None, :] < n_valid, s, -jnp.inf)            # padding rows never win
        v, i = jax.lax.top_k(s, k_local)
        i = (i + shard * local).astype(jnp.int32) + offset
        # Gather every device's candidates (device order = corpus order) and keep k of them.
        v = jax.lax.all_gather(v, BATCH_AXES, axis=1, tiled=True)
        i = jax.lax.all_gather(i, BATCH_AXES, axis=1, tiled=True)
        return v, i

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(BATCH_AXES), P(), P()),
                            out_specs=(P(), P()), check_vma=False)

    def step(q, block, n_valid, offset, best_v, best_i):
        v, i = sharded(q, block, n_valid, offset)
        v = jnp.concatenate([best_v, v], axis=1)                      # earlier blocks first: ties keep order
        i = jnp.concatenate([best_i, i], axis=1)
        v, j = jax.lax.top_k(v, k)
        return v, jnp.take_along_axis(i, j, axis=1)

    repl = replicated(mesh)
    return jax.jit(step, in_shardings=(repl, NamedSharding(mesh, P(BATCH_AXES)), repl, repl, repl, repl),
                   out_shardings=(repl, repl), donate_argnums=(4, 5))


class RowFile:
    """Float32 rows [N, d] appended to a file and read back by slices (`rows[a:b]`), as `search` reads a corpus.

    No memory map: only the rows of the slice read are held, however many the file has."""

    def __init__(self, path: str, dim: int):
        self.path, self.dim, self.rows = path, dim, 0
        open(path, "wb").close()

    def append(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"RowFile: rows {rows.shape} must be [n, {self.dim}]")
        with open(self.path, "ab") as f:
            f.write(rows.tobytes())
        self.rows += rows.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.dim)

    ndim = 2

    @property
    def nbytes(self) -> int:
        return self.rows * self.dim * 4

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: slice) -> np.ndarray:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("RowFile reads contiguous slices of rows only")
        start, stop, _ = index.indices(self.rows)
        count = max(stop - start, 0)
        return np.fromfile(self.path, np.float32, count * self.dim, offset=start * self.dim * 4).reshape(count,
                                                                                                     self.dim)


@functools.lru_cache(maxsize=32)
def _cached_block_fn(mesh: Mesh, block_size: int, k_local: int, k: int) -> Callable:
    return _block_topk_fn(mesh, block_size, k_local, k)


def search(queries: np.ndarray, corpus: np.ndarray, k: int, mesh: Mesh | None = None,
           block_size: int = 65536, query_block: int = 4096, progress: bool = False
           ) -> tuple[np.ndarray, np.ndarray]:
    """Top-k corpus rows by inner product for every query.

    queries [Q, d], corpus [N, d] (numpy, may be a memmap). Returns
    (scores [Q, min(k, N)] float32 descending, indices [Q, min(k, N)] int32).
    The corpus is read block by block (`block_size` rows, rounded up to a
    multiple of the mesh's batch shards); queries go `query_block` at a time.
    """
    if queries.ndim != 2 or corpus.ndim != 2 or queries.shape[1] != corpus.shape[1]:
        raise ValueError(f"search: queries {queries.shape} and corpus {corpus.shape} must be [Q, d] and [N, d]")
    if k < 1:
        raise ValueError(f"search: k must be >= 1, got {k}")
    n, q_total = corpus.shape[0], queries.shape[0]
    k = min(k, n)
    if q_total == 0 or k == 0:
        return np.zeros((q_total, k), np.float32), np.zeros((q_total, k), np.int32)
    mesh = mesh if mesh is not None else default_mesh()
    block = round_to_shards(min(block_size, n), mesh)
    k_local = min(k, block // batch_shards(mesh))
    fn = _cached_block_fn(mesh, block, k_local, k)
    repl, blk_sharding = replicated(mesh), NamedSharding(mesh, P(BATCH_AXES))

    starts = range(0, n, block)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="search", unit="block", dynamic_ncols=True, leave=False)
    q_chunks = [np.asarray(queries[s:s + query_block], np.float32) for s in range(0, q_total, query_block)]
    # from_host: every process holds the same queries and corpus and fills its own devices (multi-host).
    best = [(from_host(np.full((len(qc), k), -np.inf, np.float32), repl),
             from_host(np.full((len(qc), k), -1, np.int32), repl)) for qc in q_chunks]
    q_dev = [from_host(qc, repl) for qc in q_chunks]
    for start in starts:
        rows = np.asarray(corpus[start:start + block], np.float32)
        n_valid = rows.shape[0]
        if n_valid < block:
            rows = np.concatenate([rows, np.zeros((block - n_valid, rows.shape[1]), np.float32)])
        rows = from_host(rows, blk_sharding)
        n_valid_dev, start_dev = from_host(np.int32(n_valid), repl), from_host(np.int32(start), repl)
        for c, qd in enumerate(q_dev):
            best[c] = fn(qd, rows, n_valid_dev, start_dev, *best[c])
    scores = np.concatenate([np.asarray(v) for v, _ in best])
    indices = np.concatenate([np.asarray(i) for _, i in best])
    return scores, indices
