"""An on-disk embedding cache, safe with several processes."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils

from infjax.inference.embedders import EmbedFn, PairEmbedFn
from infjax.inference.truncation import Cuts
from infjax.runtime import storage

log = logging.getLogger("infjax.inference")


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
    process 0 writes entries. DIR may be an object-store URL (gs://...).

    Given a `Cuts`, an entry keeps in its JSON how many of its texts the
    encoder's max_len cut ("cut"), counted as they were encoded; a hit adds
    that count, since nothing is tokenized then. An entry without one (written
    before infjax kept it) is still a hit, and its texts are counted unknown.
    """

    def __init__(self, directory: str):
        self.directory = directory
        storage.makedirs(directory)
        if not storage.is_remote(directory) and not os.access(directory, os.W_OK):
            raise PermissionError(f"--cache_dir={directory} is not writable")

    @staticmethod
    def key(model: str, step: int | None, dataset: str, side: str, texts: list[str]) -> tuple[str, dict]:
        meta = {"model": model, "step": step, "dataset": dataset, "side": side,
                "num_texts": len(texts), "texts_sha256": texts_digest(texts)}
        return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:32], meta

    def _read_through(self, compute, key_texts: list[str], rows: int, model: str, step: int | None,
                      dataset: str, side: str, cuts: Cuts | None = None) -> np.ndarray:
        """The cached [rows, d] embeddings keyed by `key_texts`, else `compute()` (then stored); `cuts`: the count
        of cut texts that `compute` adds to, kept with the entry and added again by a hit."""
        key, meta = self.key(model, step, dataset, side, key_texts)
        path = storage.join(self.directory, key + ".npy")
        emb = None
        if storage.exists(path):
            with storage.Path(path).open("rb") as f:
                emb = np.load(f)
        if all_processes(emb is not None and emb.shape[0] == rows):
            kept = None if cuts is None else self._kept_cut(key, rows, cuts.max_len)
            unknown = "" if cuts is None or kept is not None else \
                f"; it keeps no count of the texts cut at {cuts.max_len} tokens (written by an earlier infjax)"
            log.info("embedding cache hit: %s %s (%d texts) %s%s", dataset, side, rows, path, unknown)
            if cuts is not None:
                cuts.add(rows, kept)
            return emb
        before = dataclasses.replace(cuts) if cuts is not None else None
        emb = np.asarray(compute(), np.float32)
        if jax.process_index() != 0:
            return emb
        added = cuts.since(before) if cuts is not None else None
        if added is not None and added.texts == rows and added.cut_count is not None:
            meta["cut"] = {"max_len": added.max_len, "texts": rows, "cut": added.cut_count}
        if storage.is_remote(path):                            # an object appears only when complete
            with storage.Path(path).open("wb") as f:
                np.save(f, emb)
        else:
            with storage.replacing(path, binary=True) as f:     # never a half-written entry, nor through a link
                np.save(f, emb)
        storage.write_text(storage.join(self.directory, key + ".json"), json.dumps(meta, indent=1))
        return emb

    def _kept_cut(self, key: str, rows: int, max_len: int) -> int | None:
        """How many of an entry's `rows` texts were cut at `max_len` tokens, as its JSON kept it; None where it
        kept no such count (written by an earlier infjax, or its JSON missing or unreadable)."""
        try:
            kept = json.loads(storage.read_text(storage.join(self.directory, key + ".json"))).get("cut")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(kept, dict) or (kept.get("max_len"), kept.get("texts")) != (max_len, rows):
            return None
        cut = kept.get("cut")
        return cut if type(cut) is int and 0 <= cut <= rows else None

    def wrap(self, embed: EmbedFn, model: str, step: int | None, dataset: str, side: str,
             cuts: Cuts | None = None) -> EmbedFn:
        """`embed` (texts -> embeddings) with a read-through cache keyed by the texts; `cuts`: the count of cut
        texts `embed` adds to (kept with each entry)."""
        return lambda texts: self._read_through(lambda: embed(texts), list(texts), len(texts), model, step,
                                                dataset, side, cuts)

    def wrap_pairs(self, embed_pairs: PairEmbedFn, model: str, step: int | None, dataset: str,
                   side: str = "query-pairs", cuts: Cuts | None = None) -> PairEmbedFn:
        """`embed_pairs` ((instructions, queries) -> embeddings, Interaction II) with a read-through cache
        keyed by the interleaved pairs (each text length-prefixed by texts_digest, so no two lists collide);
        `cuts`: the count of cut queries `embed_pairs` adds to."""
        def cached(instructions: list[str], queries: list[str]) -> np.ndarray:
            interleaved = [t for pair in zip(instructions, queries) for t in pair]
            return self._read_through(lambda: embed_pairs(instructions, queries), interleaved, len(queries),
                                      model, step, dataset, side, cuts)
        return cached
