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

from infjax import errors
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


def rows_digest(emb: np.ndarray) -> str:
    """sha256 over an entry's dtype, shape and rows in order: the identity of what it holds.

    About 0.09 s for 100,000 x 384 float32 (147 MiB) on a CPU with SHA instructions."""
    h = hashlib.sha256(f"{emb.dtype.str}|{tuple(emb.shape)}|".encode())
    h.update(memoryview(np.ascontiguousarray(emb)))
    return h.hexdigest()


def rows_description(emb: np.ndarray) -> dict:
    """What an entry's JSON keeps of its .npy file, checked by `check_entry`: {"shape", "dtype", "sha256"}."""
    return {"shape": list(emb.shape), "dtype": str(emb.dtype), "sha256": rows_digest(emb)}


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _read_exactly(f, size: int) -> memoryview:
    """Up to `size` bytes of `f` (fewer only at its end), in a buffer of their own (a writable array)."""
    view, got = memoryview(np.empty(size, np.uint8)), 0     # not zero-filled first: the file fills it
    while got < size:
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return view[:got]


def check_entry(f, described, meta: dict, rows: int) -> tuple[np.ndarray | None, str]:
    """(the [rows, d] float32 embeddings of the .npy file `f`, "") when its JSON `described` vouches for them.

    Else (None, why). The JSON must carry the key's own description `meta` (model, step, dataset,
    side, the texts' count and hash: another entry's pair of files is not this one) and the shape, dtype and
    digest of the rows (`rows_description`); the .npy header must say `rows` rows of float32, its data hold
    exactly that many bytes (a cut file is refused), and the rows' digest match (rows permuted, replaced by
    another entry's or damaged). Nothing is ever unpickled: a file of Python objects is refused by its header."""
    if not isinstance(described, dict):
        return None, "its description (.json) is not a JSON object"
    other = next((k for k, v in meta.items() if described.get(k) != v), None)
    if other is not None:
        return None, f"its description (.json) is of another entry ({other} {described.get(other)!r}, expected " \
                     f"{meta[other]!r})"
    kept = described.get("rows")
    if not isinstance(kept, dict) or not isinstance(kept.get("sha256"), str):
        return None, "its description (.json) keeps no digest of its rows (an earlier infjax wrote it), so they " \
                     "cannot be checked"
    try:
        shape, fortran, dtype = _NPY_HEADERS[np.lib.format.read_magic(f)](f)
    except (ValueError, KeyError, EOFError, SyntaxError) as e:
        return None, f"it is not a .npy array file ({type(e).__name__})"
    if dtype.hasobject:
        return None, "it holds pickled Python objects, which the cache never loads"
    if dtype != np.float32 or len(shape) != 2 or shape[0] != rows:
        return None, f"it holds a {dtype} array of shape {tuple(shape)}, not {rows} rows of float32"
    if [*shape] != kept.get("shape") or str(dtype) != kept.get("dtype"):
        return None, f"it holds {shape[0]} rows of width {shape[1]}, its description (.json) says " \
                     f"{kept.get('shape')} {kept.get('dtype')}"
    size = shape[0] * shape[1] * dtype.itemsize
    data = _read_exactly(f, size + 1)
    if len(data) != size:
        return None, f"it is cut short: {len(data)} of the {size} bytes its header announces" if len(data) < size \
            else f"it holds more bytes than the {size} its header announces"
    emb = np.frombuffer(data[:size], dtype).reshape(shape, order="F" if fortran else "C")
    if rows_digest(emb) != kept["sha256"]:
        return None, "its rows are not the ones it was written with (their digest differs: rows permuted, the " \
                     "file replaced or damaged)"
    return emb, ""


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

    An entry's JSON keeps its key's description and the shape, dtype and
    sha256 of its rows (`rows_description`); an entry is a hit only when
    `check_entry` finds its .npy file to hold exactly those rows. Anything
    else (rows permuted or swapped with another entry's, a cut file, a file of
    pickled objects, another width or dtype, a JSON missing or of another
    entry, an entry of an infjax that kept no digest) is a miss: one warning
    names the file and why, and the entry is computed and written again.

    Given a `Cuts`, an entry keeps in its JSON how many of its texts the
    encoder's max_len cut ("cut"), counted as they were encoded; a hit adds
    that count, since nothing is tokenized then. An entry without one (its
    encoder could not count them) is still a hit, and its texts are counted
    unknown.
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
        """The cached [rows, d] embeddings keyed by `key_texts`, else `compute()` (then stored).

        `cuts`: the count of cut texts that `compute` adds to, kept with the entry and added again by a hit. An
        entry that fails `check_entry` is a miss, with one warning naming its file and why, and is written
        again."""
        key, meta = self.key(model, step, dataset, side, key_texts)
        path = storage.join(self.directory, key + ".npy")
        emb = None
        if storage.exists(path):
            emb, why = self._load(key, meta, rows)
            if why:
                log.warning("embedding cache entry %s is not used: %s; computing it again", path, why)
        if all_processes(emb is not None):
            kept = None if cuts is None else self._kept_cut(key, rows, cuts.max_len)
            unknown = "" if cuts is None or kept is not None else \
                f"; it keeps no count of the texts cut at {cuts.max_len} tokens (they were not counted when it " \
                f"was written)"
            log.info("embedding cache hit: %s %s (%d texts) %s%s", dataset, side, rows, path, unknown)
            if cuts is not None:
                cuts.add(rows, kept)
            return emb
        before = dataclasses.replace(cuts) if cuts is not None else None
        emb = np.ascontiguousarray(compute(), np.float32)
        if jax.process_index() != 0:
            return emb
        added = cuts.since(before) if cuts is not None else None
        if added is not None and added.texts == rows and added.cut_count is not None:
            meta["cut"] = {"max_len": added.max_len, "texts": rows, "cut": added.cut_count}
        meta["rows"] = rows_description(emb)
        if storage.is_remote(path):                            # an object appears only when complete
            with storage.Path(path).open("wb") as f:
                np.save(f, emb, allow_pickle=False)
        else:
            with storage.replacing(path, binary=True) as f:     # never a half-written entry, nor through a link
                np.save(f, emb, allow_pickle=False)
        storage.write_text(storage.join(self.directory, key + ".json"), json.dumps(meta, indent=1))
        return emb

    def _load(self, key: str, meta: dict, rows: int) -> tuple[np.ndarray | None, str]:
        """(the entry's embeddings, "") when `check_entry` accepts the entry `key`, else (None, why).

        It is checked for `meta` (the key's own description) and `rows` texts."""
        try:
            described = json.loads(storage.read_text(storage.join(self.directory, key + ".json")))
        except (OSError, ValueError) as e:
            return None, f"its description {key}.json cannot be read ({type(e).__name__})"
        try:
            with storage.Path(storage.join(self.directory, key + ".npy")).open("rb") as f:
                return check_entry(f, described, meta, rows)
        except OSError as e:
            return None, f"it cannot be read ({errors.describe(e)})"

    def _kept_cut(self, key: str, rows: int, max_len: int) -> int | None:
        """How many of an entry's `rows` texts were cut at `max_len` tokens, as its JSON kept it, or None.

        None where it kept no such count (its encoder could not count them, or its JSON is missing or
        unreadable)."""
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
        """`embed` (texts -> embeddings) with a read-through cache keyed by the texts.

        `cuts`: the count of cut texts `embed` adds to (kept with each entry)."""
        return lambda texts: self._read_through(lambda: embed(texts), list(texts), len(texts), model, step,
                                                dataset, side, cuts)

    def wrap_pairs(self, embed_pairs: PairEmbedFn, model: str, step: int | None, dataset: str,
                   side: str = "query-pairs", cuts: Cuts | None = None) -> PairEmbedFn:
        """`embed_pairs` ((instructions, queries) -> embeddings, Interaction II) with a read-through cache.

        It is keyed by the interleaved pairs (each text length-prefixed by texts_digest, so no two lists collide);
        `cuts`: the count of cut queries `embed_pairs` adds to."""
        def cached(instructions: list[str], queries: list[str]) -> np.ndarray:
            interleaved = [t for pair in zip(instructions, queries) for t in pair]
            return self._read_through(lambda: embed_pairs(instructions, queries), interleaved, len(queries),
                                      model, step, dataset, side, cuts)
        return cached
