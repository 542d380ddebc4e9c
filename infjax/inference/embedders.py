"""Texts -> embeddings with a trained encoder: jitted, sharded over the mesh's batch axes.

`TextEmbedder` encodes one text per row (passages, and instruction-aware
queries under Interaction I); `CrossAttentionQueryEmbedder` encodes the
instruction and the query apart and combines them with the interaction head
(Interaction II), as in training.

Packed (the default): texts are tokenized CHUNK_TEXTS at a time, each chunk placed best fit by
decreasing length into rows of a few static widths (powers of two from 32 up
to max_len): a long text opens a row of its own size and short texts fill the
gaps, so almost no token is padding and attention spans stay short. Each
encoder call takes a fixed number of rows of one width (`tokens_per_call`:
about `batch_size` x 128 tokens on accelerators, 1,024 per device on CPU),
one compiled shape per width; the empty rows of a width's last
call take narrower rows side by side, and only a chunk's last call is
shorter (data.packing.plan_calls). Padded (packed=False): texts sorted
by length, each batch padded to the smallest bucket that holds its longest
text. Results come back in the input order either way. Given a `Cuts`, an
embedder counts the texts it encodes and those max_len cuts, from the
tokenizer calls that make its input (inference.truncation).
"""
from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from infjax.data import packing
from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.inference import truncation
from infjax.inference.truncation import Cuts
from infjax.models import interaction
from infjax.models.encoder import Encoder, query_params
from infjax.runtime import cpu as runtime_cpu
from infjax.runtime.mesh import batch_shards, batch_sharding, put, replicated, round_to_shards

EmbedFn = Callable[[list[str]], np.ndarray]                    # texts -> L2-normalized embeddings [N, d]
PairEmbedFn = Callable[[list[str], list[str]], np.ndarray]     # (instructions, queries) -> iq embeddings


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
    return jax.jit(_rows_split(encoder, mesh), out_shardings=replicated(mesh))


@functools.lru_cache(maxsize=8)
def _jitted_packed(encoder: Encoder, mesh: Mesh):
    """`_jitted_encoder` for packed inputs (data.packing layout; [S, ...] split over the batch shards)."""
    return jax.jit(_rows_split(encoder, mesh).packed, out_shardings=replicated(mesh))


def _rows_split(encoder: Encoder, mesh: Mesh) -> Encoder:
    """The encoder with its activations' rows held on the batch axes, as in training.

    The per-device attention kernels (Pallas GPU, TPU splash) then run under shard_map on each device's own
    rows."""
    return encoder.with_activation_sharding(batch_sharding(mesh)) if isinstance(encoder, Encoder) else encoder


TOKENS_PER_CALL = 128          # x batch_size: tokens of one packed encoder call
# Texts tokenized and placed at once by a packed embedder: its host memory is bounded by a chunk, not the corpus
# (a chunk's last call per width is the only one it leaves partly empty: a few calls per 16k texts).
CHUNK_TEXTS = 16384


def tokens_per_call(batch_size: int, mesh: Mesh) -> int:
    """Tokens of one packed encoder call: ``batch_size`` x 128 on GPU/TPU, at most 1,024 per device on CPU.

    Big calls keep the matrix units busy; on CPU small ones keep a call's activations in the caches (MiniLM at
    max_len 128 on 2 cores: 8,192-token calls encode ~62 docs/s, 1,024-token calls ~85)."""
    return runtime_cpu.cap_call_tokens(batch_size * TOKENS_PER_CALL, mesh, batch_shards(mesh))


class TextEmbedder:
    """texts -> L2-normalized float32 embeddings [N, d], in fixed-shape, length-bucketed batches."""

    def __init__(self, encoder: Encoder, mesh: Mesh, tokenizer: Tokenizer, batch_size: int, bucketed: bool = True,
                 packed: bool = True, call_tokens: int | None = None):
        self.batch_size = round_to_shards(batch_size, mesh)
        self.call_tokens = call_tokens or tokens_per_call(self.batch_size, mesh)    # packed calls
        self.tokenizer, self.mesh, self.bucketed, self.packed = tokenizer, mesh, bucketed, packed
        self.shards = batch_shards(mesh)
        self.stats = {"real_tokens": 0, "buffer_tokens": 0, "host_s": 0.0}
        self.chunk_texts = CHUNK_TEXTS
        self._slots: dict[tuple[int, int], int] = {}         # call shape -> the most text slots a chunk gave it
        self._segments: dict[tuple[int, int], int] = {}      # ... and segment slots
        self._rows = batch_sharding(mesh)
        self.left_padded = getattr(encoder, "padding_side", "right") == "left"
        try:
            self._fn, self._packed_fn = _jitted_encoder(encoder, mesh), _jitted_packed(encoder, mesh)
        except TypeError:                                          # an unhashable encoder: no sharing
            self._fn = _jitted_encoder.__wrapped__(encoder, mesh)
            self._packed_fn = _jitted_packed.__wrapped__(encoder, mesh)

    def _trim(self, ids: np.ndarray, mask: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Cut a batch padded to max_len down to the smallest bucket that holds its longest text."""
        if not self.bucketed:
            return ids, mask
        longest = int(mask.sum(axis=1).max()) if mask.size else 0
        width = next(b for b in length_buckets(max_len) if b >= longest)
        cut = slice(max_len - width, None) if self.left_padded else slice(0, width)
        return ids[:, cut], mask[:, cut]

    def __call__(self, params, texts: list[str], max_len: int, progress: str | None = None,
                 cuts: Cuts | None = None) -> np.ndarray:
        """Embeddings of `texts` in their order.

        `progress` names a tqdm bar (None: no bar); `cuts` (when given) counts the texts and those max_len cuts,
        as they are tokenized for the encoder."""
        texts = list(texts)
        if not texts:
            return np.zeros((0, 0), np.float32)
        if self.packed:
            return self._packed_call(params, texts, max_len, progress, cuts)
        # Longest first (by characters, a cheap proxy for tokens): similar lengths share a batch.
        order = np.argsort(-np.fromiter((len(t) for t in texts), np.int64, len(texts)), kind="stable")

        def jobs():
            for start in range(0, len(texts), self.batch_size):
                rows = order[start:start + self.batch_size]
                chunk = [texts[i] for i in rows] + [""] * (self.batch_size - len(rows))   # static shape
                # Every process tokenizes (and counts) the whole batch and feeds its own devices' rows (multi-host).
                ids, mask = self._trim(*truncation.padded(self.tokenizer, chunk, max_len, cuts, len(rows)), max_len)
                owners = np.concatenate([rows, np.full(self.batch_size - len(rows), -1)])
                yield self._fn(params, *put((ids, mask), self._rows)), owners

        return self._pipeline(jobs(), len(texts), progress)

    def _pipeline(self, jobs, n: int, progress: str | None) -> np.ndarray:
        """Collect (device result [M, d], owners [M]) pairs into [n, d] in text order.

        `owners` gives the text of each row (-1: none); one call is in flight, so host work overlaps the
        device."""
        bar = None
        if progress is not None:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, desc=progress, unit="text", dynamic_ncols=True, leave=False)
        out: np.ndarray | None = None
        pending = None

        def collect(item):
            nonlocal out
            result, owners = item
            emb = np.asarray(result)
            if out is None:
                out = np.zeros((n, emb.shape[1]), np.float32)
            owners = owners.reshape(-1)
            used = owners >= 0
            out[owners[used]] = emb[used]
            if bar is not None:
                bar.update(int(used.sum()))

        for item in jobs:                                          # each call is dispatched asynchronously
            if pending is not None:
                collect(pending)
            pending = item
        collect(pending)
        if bar is not None:
            bar.close()
        return out

    def calls(self, tokens: list[np.ndarray], max_len: int) -> list[tuple[int, list[list[int]], int, int]]:
        """The packed encoder calls of a corpus: (width, rows of text indices, text slots, segment slots).

        Text slots are per shard, segment slots per row; each is the most of any call of the same shape (one
        compiled shape each)."""
        widths = list(length_buckets(max_len, 32))
        rows = packing.best_fit_rows([len(t) for t in tokens], widths)
        per_call = {w: round_to_shards(max(self.call_tokens // w, 1), self.mesh) for w in widths}
        planned = packing.plan_calls(rows, per_call, self.shards)
        slots: dict[tuple[int, int], int] = {}                  # most texts in a shard, per call shape
        segments: dict[tuple[int, int], int] = {}               # most texts in a row, per call shape
        for width, rows in planned:
            per_shard = len(rows) // self.shards
            most = max(sum(len(r) for r in rows[s * per_shard:(s + 1) * per_shard]) for s in range(self.shards))
            slots[width, len(rows)] = max(slots.get((width, len(rows)), 0), -(-most // 8) * 8)
            segments[width, len(rows)] = max(segments.get((width, len(rows)), 2),
                                             packing.segment_bound(max((len(r) for r in rows), default=1)))
        return [(width, rows, slots[width, len(rows)], segments[width, len(rows)]) for width, rows in planned]

    def _packed_call(self, params, texts: list[str], max_len: int, progress: str | None,
                     cuts: Cuts | None = None) -> np.ndarray:
        """Packed encoding, `chunk_texts` texts at a time.

        A chunk is tokenized, placed and encoded before the next chunk is tokenized: the host holds one chunk's
        tokens whatever the number of texts. A call shape keeps the most
        text and segment slots any chunk gave it, so later chunks reuse its compiled program. Every process
        tokenizes (and counts) the whole chunk and places its own devices' shards."""

        def jobs():
            for lo in range(0, len(texts), self.chunk_texts):
                t0 = time.perf_counter()
                tokens = truncation.tokens(self.tokenizer, texts[lo:lo + self.chunk_texts], max_len, cuts)
                calls = self.calls(tokens, max_len)
                self.stats["host_s"] += time.perf_counter() - t0
                for width, rows, slots, segments in calls:
                    t0 = time.perf_counter()
                    key = (width, len(rows))
                    slots = self._slots[key] = max(self._slots.get(key, 0), slots)
                    segments = self._segments[key] = max(self._segments.get(key, 0), segments)
                    arrays, owners = packing.pack_rows(tokens, rows, self.shards, width, slots,
                                                       self.tokenizer.pad_id, segments)
                    self.stats["real_tokens"] += int((arrays["mask"] > 0).sum())
                    self.stats["buffer_tokens"] += arrays["mask"].size
                    inputs = put(arrays, self._rows)                   # each process: its devices' shards
                    self.stats["host_s"] += time.perf_counter() - t0
                    yield self._packed_fn(params, inputs), np.where(owners >= 0, owners + lo, -1)

        return self._pipeline(jobs(), len(texts), progress)


class CrossAttentionQueryEmbedder:
    """(instructions, queries) -> iq embeddings [N, d] through the interaction head."""

    def __init__(self, encoder: Encoder, mesh: Mesh, tokenizer: Tokenizer, fmt: TextFormat, batch_size: int):
        self.batch_size = round_to_shards(batch_size, mesh)
        self.tokenizer, self.fmt = tokenizer, fmt

        def embed(params, i_ids, i_mask, q_ids, q_mask):
            qp = query_params(params)
            i_vec = encoder(qp, i_ids, i_mask)
            return interaction.iq_embeddings(params["interaction"], i_vec, encoder.hidden(qp, q_ids, q_mask, max_segments=1),
                                              q_mask)

        self._rows = batch_sharding(mesh)
        # Inputs come as global arrays (params as the caller holds them, rows through `put`): no in_shardings.
        self._fn = jax.jit(embed, out_shardings=replicated(mesh))

    def __call__(self, params, instructions: list[str], queries: list[str], max_len: int,
                 cuts: Cuts | None = None) -> np.ndarray:
        """iq embeddings of the pairs in their order.

        `cuts` (when given) counts the queries and those max_len cuts, as they are tokenized for the encoder."""
        if len(instructions) != len(queries):
            raise ValueError(f"{len(instructions)} instructions but {len(queries)} queries")
        out = []
        for start in range(0, len(queries), self.batch_size):
            ins = [self.fmt.alone(t) for t in instructions[start:start + self.batch_size]]
            qs = [self.fmt.alone(t) for t in queries[start:start + self.batch_size]]
            n = len(qs)
            pad = [""] * (self.batch_size - n)
            i_ids, i_mask = self.tokenizer(ins + pad, max_len)
            q_ids, q_mask = truncation.padded(self.tokenizer, qs + pad, max_len, cuts, n)
            q_mask[n:, 0] = 1                      # padding rows: one attended token, no NaN
            inputs = put((i_ids, i_mask, q_ids, q_mask), self._rows)   # each process: its devices' rows
            out.append(np.asarray(self._fn(params, *inputs))[:n])
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
