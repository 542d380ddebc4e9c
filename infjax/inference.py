"""Encoding lists of texts with a trained encoder: jitted, sharded over the mesh's batch axes.

Texts are sorted by length and each batch is padded only to the smallest of a
few static length buckets (powers of two up to max_len) that holds its
longest text, so short texts cost little and the number of compiled shapes
stays small. Results come back in the input order.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from infjax.data.tokenize import Tokenizer
from infjax.models.encoder import Encoder
from infjax.training.mesh import batch_sharding, put, replicated

log = logging.getLogger("infjax.inference")


def length_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Static padded lengths: powers of two from `smallest` below `max_len`, then `max_len` itself."""
    buckets, b = [], smallest
    while b < max_len:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (max_len,)


@functools.lru_cache(maxsize=8)
def _jitted_encoder(encoder: Encoder, mesh: Mesh):
    """One jitted encoder per (encoder, mesh): equal encoders loaded twice share their compiled shapes.

    No in_shardings: every input arrives as a global array with its own sharding (the batch split over
    the batch axes by `put`; the params as the caller holds them, e.g. FSDP-sharded in the trainer,
    where XLA gathers each weight where it is used), so nothing is resharded or refused across hosts.
    """
    return jax.jit(encoder, out_shardings=replicated(mesh))


class TextEmbedder:
    """texts -> L2-normalized float32 embeddings [N, d], in fixed-shape, length-bucketed batches."""

    def __init__(self, encoder: Encoder, mesh: Mesh, tokenizer: Tokenizer, batch_size: int, bucketed: bool = True):
        n_shards = mesh.shape["data"] * mesh.shape["fsdp"]
        self.batch_size = -(-batch_size // n_shards) * n_shards    # a multiple of the batch shards
        self.tokenizer, self.mesh, self.bucketed = tokenizer, mesh, bucketed
        self._rows = batch_sharding(mesh)
        self.left_padded = getattr(encoder, "padding_side", "right") == "left"
        try:
            self._fn = _jitted_encoder(encoder, mesh)
        except TypeError:                                          # an unhashable encoder: no sharing
            self._fn = _jitted_encoder.__wrapped__(encoder, mesh)

    def _trim(self, ids: np.ndarray, mask: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Cut a batch padded to max_len down to the smallest bucket that holds its longest text."""
        if not self.bucketed:
            return ids, mask
        longest = int(mask.sum(axis=1).max()) if mask.size else 0
        width = next(b for b in length_buckets(max_len) if b >= longest)
        cut = slice(max_len - width, None) if self.left_padded else slice(0, width)
        return ids[:, cut], mask[:, cut]

    def __call__(self, params, texts: list[str], max_len: int, progress: str | None = None) -> np.ndarray:
        """Embeddings of `texts` in their order; `progress` names a tqdm bar (None: no bar)."""
        texts = list(texts)
        if not texts:
            return np.zeros((0, 0), np.float32)
        # Longest first (by characters, a cheap proxy for tokens): similar lengths share a batch.
        order = np.argsort(-np.fromiter((len(t) for t in texts), np.int64, len(texts)), kind="stable")
        bar = None
        if progress is not None:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(texts), desc=progress, unit="text", dynamic_ncols=True, leave=False)
        out: np.ndarray | None = None
        pending = None                                             # (device result, rows): one batch in flight

        def collect(item):
            nonlocal out
            result, rows = item
            emb = np.asarray(result)[:len(rows)]
            if out is None:
                out = np.zeros((len(texts), emb.shape[1]), np.float32)
            out[rows] = emb
            if bar is not None:
                bar.update(len(rows))

        for start in range(0, len(texts), self.batch_size):
            rows = order[start:start + self.batch_size]
            chunk = [texts[i] for i in rows]
            chunk += [""] * (self.batch_size - len(chunk))        # static shape: pad the last batch
            ids, mask = self._trim(*self.tokenizer(chunk, max_len), max_len)
            # Every process tokenizes the whole batch and feeds its own devices' rows (multi-host).
            result = self._fn(params, *put((ids, mask), self._rows))   # dispatched asynchronously
            if pending is not None:
                collect(pending)                                   # host work overlaps the device
            pending = (result, rows)
        collect(pending)
        if bar is not None:
            bar.close()
        return out


EmbedFn = Callable[[list[str]], np.ndarray]


def texts_digest(texts: list[str]) -> str:
    """sha256 over the texts (length-prefixed, so that no two lists collide by concatenation)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def all_processes(flag: bool) -> bool:
    """True when `flag` holds on every process (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


class EmbeddingCache:
    """On-disk embeddings keyed by (model, step, dataset, side, texts hash): DIR/<key>.npy plus DIR/<key>.json.

    The texts are the encoder's final input (template and prefixes applied),
    so a change of template, prefix or text gives a new key; `model` should
    name everything else that changes the embeddings (weights, pooling,
    max length).

    With several processes the encoder is a collective, so they must agree on
    hit or miss: an entry counts as a hit only when every process can read
    it (a cache folder that is not shared gives misses, never a hang); only
    process 0 writes entries.
    """

    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError(f"--cache_dir={directory} is not writable")

    @staticmethod
    def key(model: str, step: int | None, dataset: str, side: str, texts: list[str]) -> tuple[str, dict]:
        meta = {"model": model, "step": step, "dataset": dataset, "side": side,
                "num_texts": len(texts), "texts_sha256": texts_digest(texts)}
        return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32], meta

    def wrap(self, embed: EmbedFn, model: str, step: int | None, dataset: str, side: str) -> EmbedFn:
        """`embed` with a read-through cache."""

        def cached(texts: list[str]) -> np.ndarray:
            key, meta = self.key(model, step, dataset, side, list(texts))
            path = os.path.join(self.directory, key + ".npy")
            emb = np.load(path) if os.path.isfile(path) else None
            if all_processes(emb is not None and emb.shape[0] == len(texts)):
                log.info("embedding cache hit: %s %s (%d texts) %s", dataset, side, len(texts), path)
                return emb
            emb = np.asarray(embed(texts), np.float32)
            if jax.process_index() != 0:
                return emb
            tmp = path + f".tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                np.save(f, emb)
            os.replace(tmp, path)                                  # atomic: never a half-written entry
            with open(os.path.join(self.directory, key + ".json"), "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
            return emb

        return cached
