"""Pack: the texts of one encoder input, without padding, in fixed-shape rows with segment ids.

Each batch shard (one device's slice of the batch) packs its own texts into
``rows`` rows of ``length`` tokens, first-fit by decreasing length. The packed
input of ``S`` shards holding ``n`` texts each is a dict of int32 arrays::

    ids    [S, rows, length]   token ids (the tokenizer's pad id on the unused tail)
    mask   [S, rows, length]   segment ids: 1, 2, ... one per text of the row, 0 on the tail
    text   [S, rows, length]   which of the shard's n texts a token belongs to (n on the tail)
    first  [S, n]              flat index (row * length + column) of each text's first token
    last   [S, n]              ... and of its last token
    segments [S, rows, M]      the token count of each text of a row, in row order (0 past its last text)

``segments`` carries M, the most texts a row may hold, in its shape: a static bound that the attention
kernels which keep per-text state (cuDNN's packed attention keeps [rows * M, heads, length] softmax
statistics) are traced with. M is measured with the row counts over the measured steps of a run (`Shapes.texts`)
and rounded up to a power of two, at least 2 (`segment_bound`); a row never holds more.

``text``, ``first`` and ``last`` are in the shard's text order, so pooling
(models.pooling.pool_packed) returns the embeddings in the original row order
whatever the placement. A padded batch is the special case of one text per
row. Nothing is ever dropped: a shard whose texts
do not fit raises :class:`PackingOverflow`, which names what to raise.

Gradient caching encodes a side in ``C`` chunks (training/gradcache.py). Each
chunk is then packed apart: the arrays get a chunk axis after the shard axis
(``ids [S, C, rows, length]``, ``first [S, C, n / C]``) and chunk ``c`` of a
shard holds its texts ``c, c + C, c + 2C, ...`` (strided, as gradcache chunks
padded rows), so ``rows`` and ``first``/``last`` count within one chunk.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from infjax.errors import UserError

KEYS = ("ids", "mask", "text", "first", "last", "segments")


class PackingOverflow(UserError, ValueError):
    """The texts of a shard do not fit its fixed packing capacity."""


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Fixed shape of one encoder input's packed buffers per batch shard."""

    rows: int
    length: int
    texts: int | None = None       # the most texts one row may hold, M (None: as many as fit)

    @property
    def tokens(self) -> int:
        return self.rows * self.length

    def segment_slots(self, count: int) -> int:
        """M, the `segments` width of a shard packing `count` texts.

        `texts`, else `segment_bound` of the most that could share a row."""
        return self.texts if self.texts is not None else segment_bound(min(count, self.length))


def segment_bound(most: int) -> int:
    """The static bound M for rows holding at most `most` texts: the next power of two, at least 2.

    A power of two, so that a handful of measured values give few distinct compiled shapes; at least 2,
    because JAX passes cuDNN the text offsets only when a row may hold more than one."""
    m = 2
    while m < most:
        m *= 2
    return m


def place(lengths: Sequence[int], length: int, max_texts: int | None = None) -> tuple[list[int], int]:
    """First-fit by decreasing length (ties: lower index first): the row of each text and the number of rows.

    A text goes into the first row (in the order rows were opened) with room for it and fewer than `max_texts`
    texts (None: no limit); a row that can take no more (full, or less room than the shortest text) is no
    longer searched."""
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    limit = max_texts or n + 1
    smallest = min(lengths) if n else 0
    free: list[int] = []
    count: list[int] = []
    row_of = [0] * n
    open_rows: list[int] = []
    for i in order:
        need = lengths[i]
        if need > length:
            raise PackingOverflow(f"a text of {need} tokens does not fit a pack length of {length}")
        for k, r in enumerate(open_rows):
            if free[r] >= need:
                free[r] -= need
                count[r] += 1
                row_of[i] = r
                if count[r] >= limit or free[r] < smallest:
                    del open_rows[k]
                break
        else:
            row_of[i] = r = len(free)
            free.append(length - need)
            count.append(1)
            if count[r] < limit and free[r] >= smallest:
                open_rows.append(r)
    return row_of, len(free)


def groups(count: int, shards: int, chunks: int = 1) -> list[list[range]]:
    """Text indices packed together: [shard][chunk] -> range.

    Shard s holds texts s*n .. (s+1)*n - 1 (n = count / shards); its chunk c the texts s*n + c,
    s*n + c + chunks, ... (strided)."""
    if count % (shards * chunks):
        raise ValueError(f"{count} texts do not split into {shards} batch shards x {chunks} chunks")
    n = count // shards
    return [[range(s * n + c, (s + 1) * n, chunks) for c in range(chunks)] for s in range(shards)]


def pack_flat(flat: np.ndarray, lengths: np.ndarray, shards: int, capacity: Capacity, pad_id: int,
              what: str = "texts", chunks: int | None = None) -> dict:
    """Texts in row order -> packed arrays [S, ...] (with `chunks`, gradient caching: [S, C, ...]; module doc).

    The texts are given as one array of all their ids (`flat`, text after text, each already cut to its max
    length) and their `lengths`. The placement (`place`) is decided per shard (and chunk) in Python, every
    array is written at once. A shard whose texts need more rows than `capacity` raises PackingOverflow,
    naming `what`."""
    count = len(lengths)
    c = chunks or 1
    if count % (shards * c):
        raise ValueError(f"{what}: {count} texts do not split into {shards} batch shards x {chunks} chunks")
    per = count // (shards * c)                      # texts of one shard (chunk)
    slots = capacity.segment_slots(count // shards if chunks is None else per)
    rows, width = capacity.rows, capacity.length
    lengths = np.asarray(lengths, np.int64)
    # text t of shard s, chunk j is member k: t = s * (per * c) + j + k * c
    t = np.arange(count)
    shard, within = np.divmod(t, per * c)
    chunk, member = within % c, within // c
    block = shard * c + chunk                        # which (shard, chunk) block packs the text
    row_of = np.empty(count, np.int64)
    by_block = np.argsort(block, kind="stable").reshape(shards * c, per)   # each block's texts in member order
    for b, members in enumerate(by_block):
        placed, used = place(lengths[members].tolist(), width, slots)
        if used > rows:
            s, j = divmod(b, c)
            where = f"{what}, shard {s}" + (f", chunk {j}" if chunks else "")
            limit = f", at most {slots} texts a row" if capacity.texts is not None else ""
            raise PackingOverflow(f"{where}: {per} texts ({int(lengths[members].sum())} tokens) need {used} packed "
                                  f"rows of {width} tokens{limit} but the capacity is {rows} rows")
        row_of[members] = placed
    # inside a row, texts keep their order: column = the lengths of the row's earlier texts
    key = (block * rows + row_of) * count + t
    order = np.argsort(key, kind="stable")
    row_id = (block * rows + row_of)[order]
    starts_row = np.r_[True, row_id[1:] != row_id[:-1]]
    csum = np.cumsum(lengths[order]) - lengths[order]
    col = np.empty(count, np.int64)
    col[order] = csum - np.maximum.accumulate(np.where(starts_row, csum, 0))
    rank = np.empty(count, np.int64)
    run = np.arange(count) - np.maximum.accumulate(np.where(starts_row, np.arange(count), 0))
    rank[order] = run + 1                            # segment id: 1, 2, ... in the row
    start = (block * rows + row_of) * width + col    # flat position of each text's first token
    out = {"ids": np.full((shards * c, rows, width), pad_id, np.int32),
           "mask": np.zeros((shards * c, rows, width), np.int32),
           "text": np.full((shards * c, rows, width), per, np.int32),
           "segments": np.zeros((shards * c, rows, slots), np.int32)}
    offsets = np.cumsum(lengths) - lengths
    dest = np.repeat(start - offsets, lengths) + np.arange(int(lengths.sum()))
    out["ids"].reshape(-1)[dest] = flat
    out["mask"].reshape(-1)[dest] = np.repeat(rank, lengths)
    out["text"].reshape(-1)[dest] = np.repeat(member, lengths)
    out["segments"].reshape(-1)[(block * rows + row_of) * slots + rank - 1] = lengths
    in_block = row_of * width + col
    first = np.zeros((shards * c, per), np.int32)
    last = np.zeros((shards * c, per), np.int32)
    first[block, member] = in_block
    last[block, member] = in_block + lengths - 1
    out["first"], out["last"] = first, last
    shape = (shards, c) if chunks else (shards,)
    return {k: out[k].reshape(*shape, *out[k].shape[1:]) for k in KEYS}


def pad_flat(flat: np.ndarray, lengths: np.ndarray, max_len: int, pad_id: int, left: bool = False
             ) -> tuple[np.ndarray, np.ndarray]:
    """Texts given as `pack_flat` takes them -> ids and a 0/1 mask [T, max_len], each text on its own row.

    Padded on the right, or on the `left` (decoders read the last token)."""
    lengths = np.asarray(lengths, np.int64)
    ids = np.full((len(lengths), max_len), pad_id, np.int32)
    mask = np.zeros((len(lengths), max_len), np.int32)
    col0 = (max_len - lengths) if left else np.zeros_like(lengths)
    offsets = np.cumsum(lengths) - lengths
    dest = np.repeat(np.arange(len(lengths)) * max_len + col0 - offsets, lengths) + np.arange(int(lengths.sum()))
    ids.reshape(-1)[dest] = flat
    mask.reshape(-1)[dest] = 1
    return ids, mask


def capacity_for(lengths_per_batch: Sequence[Sequence[int]], shards: int, length: int, chunks: int = 1) -> Capacity:
    """The smallest capacity that holds every batch listed, and the most texts any of its rows holds.

    Each batch is its texts' lengths in row order, split over `shards` and each shard's texts over `chunks`;
    `texts` is `segment_bound` of the most texts a row holds."""
    rows, most = 1, 1
    for lengths in lengths_per_batch:
        for shard in groups(len(lengths), shards, chunks):
            for members in shard:
                row_of, used = place([lengths[i] for i in members], length)
                rows = max(rows, used)
                most = max(most, int(np.bincount(row_of).max()) if row_of else 1)
    return Capacity(rows, length, segment_bound(most))


# --------------------------------------------------------------------------
# The shapes of a run: row length per side, and a few row counts (one compiled step each)
# --------------------------------------------------------------------------

# Cost model of a packed row: every token pays the dense layers once and, where attention computes the
# whole row, attends over the whole row, so a row of L tokens costs L * (1 + L / span) token-units. The span
# is the row length at which attention would cost as much as the dense layers: its FLOPs alone put it at
# 2H + I tokens (2304 for MiniLM, 4608 for BERT-base), and on CPU whole-row attention ran at about half the
# dense layers' speed when this model was set (2026-11-24, commit ecdec1c; its timings are not in the
# repository). Attention that computes only each text's own keys (the CPU kernel,
# models/attention.costs_per_text) costs a text the same in any row: its span is infinite, a row costs its
# length, and the longest rows that waste the least padding win.
ATTENTION_SPAN = 1024
LENGTH_STEP = 32             # row lengths are multiples of this ...
BLOCKWISE_LENGTH = 128       # ... and, from 512 tokens on (blockwise attention), of its query block
SAMPLE_STEPS = 64            # batches over which the row length is chosen


def row_cost(length: int, span: float = ATTENTION_SPAN) -> float:
    """Relative encoder cost of one packed row of `length` tokens (see ATTENTION_SPAN; math.inf: per text)."""
    return length * (1 + length / span)


def candidate_lengths(longest: int, multiple: int = LENGTH_STEP) -> list[int]:
    """Row lengths worth trying for texts of at most `longest` tokens.

    Multiples of LENGTH_STEP (or of `multiple`, a multiple of it: what the platform's attention kernel needs,
    e.g. 128 for TPU splash) from `longest` up to twice that (at least 128), those of 512 or more multiples of
    BLOCKWISE_LENGTH."""
    step = max(LENGTH_STEP, multiple)
    low = -(-longest // step) * step
    return [n for n in range(low, max(2 * low, 128) + 1, step) if n < 512 or n % BLOCKWISE_LENGTH == 0]


def choose_length(lengths_per_batch: Sequence[Sequence[int]], shards: int, chunks: int = 1,
                  span: float = ATTENTION_SPAN, multiple: int = LENGTH_STEP) -> int:
    """The row length of least mean cost over the batches given (at most SAMPLE_STEPS of them).

    The cost of a batch is the rows it needs x row_cost(length, span); the lengths tried are the
    `candidate_lengths` of the longest text of all of them. A longer row holds more texts, so less of it is
    padding, but (finite span) each of its tokens attends over more of it."""
    longest = max(max(lengths) for lengths in lengths_per_batch)
    sample = lengths_per_batch[:SAMPLE_STEPS]
    costs = {n: np.mean([capacity_for([lengths], shards, n, chunks).rows for lengths in sample]) * row_cost(n, span)
             for n in candidate_lengths(longest, multiple)}
    return min(costs, key=lambda n: (costs[n], n))


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The packed shapes of a run: per side a row length, and a few sets of row counts (one compiled step each).

    Each set of counts is one shape, i.e. one compiled train step; `steps` are the steps they were measured
    over (ascending) and `of_step` the shape each of those uses (its index into `rows`). `largest` holds every
    measured step.

    A step that was not measured is fitted when it is built (`fit`): its rows per side counted at the row
    lengths and at most `texts` texts a row, then the cheapest shape that holds it; one that no shape holds
    adds a shape (`grown`), so nothing is cut or dropped whatever the sample missed."""

    lengths: dict[str, int]
    rows: tuple[dict[str, int], ...]
    of_step: np.ndarray
    largest: dict[str, int]
    texts: dict[str, int] | None = None     # side -> M, the most texts a row holds (segment_bound; None: unbounded)
    steps: np.ndarray | None = None         # the measured steps, ascending (None: 0 .. len(of_step) - 1)
    span: float = ATTENTION_SPAN            # row_cost's span: which shape is cheapest
    multiple: int = LENGTH_STEP             # what a row length grown at run time is a multiple of

    def capacities(self, rows: dict[str, int]) -> dict[str, Capacity]:
        return {side: Capacity(n, self.lengths[side], (self.texts or {}).get(side)) for side, n in rows.items()}

    def measured(self) -> np.ndarray:
        return np.arange(len(self.of_step)) if self.steps is None else self.steps

    def at(self, step: int) -> dict[str, Capacity] | None:
        """Capacities per side of the shape of `step`; None for a step not measured (see `fit`)."""
        steps = self.measured()
        i = int(np.searchsorted(steps, step))
        if i < len(steps) and steps[i] == step:
            return self.capacities(self.rows[int(self.of_step[i])])
        return None

    def first_step_of(self, shape: int) -> int:
        """A measured step packed in `shape` (the first such; step 0 if none)."""
        hits = np.flatnonzero(self.of_step == shape)
        return int(self.measured()[hits[0]]) if len(hits) else 0

    def cost(self, rows: dict[str, int]) -> float:
        return sum(n * row_cost(self.lengths[side], self.span) for side, n in rows.items())

    def fit(self, lengths: dict[str, Sequence[int]], shards: int, chunks: dict[str, int] | None = None
            ) -> tuple[Shapes, dict[str, Capacity], str | None]:
        """The shape of a batch that was not measured: (shapes, capacities, note).

        `lengths`: per side, the token counts of its texts in row order over all processes. Sides missing from
        `lengths` keep their rows (fixed by the config). A side's text longer than its row length lengthens that
        side's rows (to the least candidate length that holds it), every shape then compiling anew; rows beyond every
        shape add a shape that holds them and every earlier one. `note` says what grew (None: nothing did); the
        shapes returned replace these, and no step is measured any more where a row length grew."""
        grown_lengths = dict(self.lengths)
        for side, counts in lengths.items():
            longest = max(counts, default=0)
            if longest > grown_lengths[side]:
                grown_lengths[side] = candidate_lengths(longest, self.multiple)[0]
        need = {}
        for side, counts in lengths.items():
            limit = (self.texts or {}).get(side)
            need[side] = max(place([counts[i] for i in members], grown_lengths[side], limit)[1]
                             for shard in groups(len(counts), shards, (chunks or {}).get(side, 1)) for members in shard)
        shapes, notes = self, []
        if grown_lengths != self.lengths:
            changed = {s: (self.lengths[s], n) for s, n in grown_lengths.items() if n != self.lengths[s]}
            notes.append("row length " + ", ".join(f"{s} {a} -> {b} tokens" for s, (a, b) in changed.items()))
            shapes = dataclasses.replace(self, lengths=grown_lengths, steps=np.zeros(0, np.int64),
                                         of_step=np.zeros(0, np.int32))
        holding = [r for r in shapes.rows if all(r[side] >= n for side, n in need.items())]
        if holding:
            rows = min(holding, key=shapes.cost)          # the first of equal cost (rows are widest first)
        else:
            rows = {side: max(n, need.get(side, 0)) for side, n in shapes.largest.items()}
            notes.append("rows " + ", ".join(f"{s} {shapes.largest[s]} -> {n}" for s, n in rows.items()
                                              if n != shapes.largest[s]) + " (a further shape)")
            shapes = dataclasses.replace(shapes, rows=(rows,) + shapes.rows, largest=rows,
                                         of_step=shapes.of_step + 1)
        return shapes, shapes.capacities(rows), "; ".join(notes) or None


def choose_shapes(needs: np.ndarray, row_costs: np.ndarray, count: int, min_gain: float = 0.0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Up to `count` row-count vectors ("shapes") that hold every step, and each step's shape.

    needs: [steps, sides] rows each step needs per side; row_costs: [sides] the cost of one row of each
    side. The first shape is the most of every side (it holds every step); each further one is chosen
    greedily among the steps' own needs as the one that lowers the run's total cost (each step running
    in its cheapest shape that holds it) the most, while that lowers it by more than `min_gain` of the
    total. Returns (shapes [n, sides], widest first; shape index of each step [steps]). Deterministic."""
    distinct, inverse, counts = np.unique(needs, axis=0, return_inverse=True, return_counts=True)
    inverse = np.asarray(inverse).reshape(-1)
    cost = distinct @ row_costs                                          # [distinct]
    holds = np.all(distinct[:, None, :] >= distinct[None, :, :], axis=-1)  # [candidate, need]
    shapes = [needs.max(axis=0)]
    current = np.full(len(distinct), shapes[0] @ row_costs)
    while len(shapes) < count:
        gain = (holds * np.maximum(current[None, :] - cost[:, None], 0) * counts[None, :]).sum(axis=1)
        best = int(np.argmax(gain))
        if gain[best] <= min_gain * float(current @ counts):
            break
        shapes.append(distinct[best])
        current = np.where(holds[best], np.minimum(current, cost[best]), current)
    shapes = np.stack(shapes)
    fits = np.all(shapes[:, None, :] >= distinct[None, :, :], axis=-1)      # [shape, need]
    choice = np.argmin(np.where(fits, (shapes @ row_costs)[:, None], np.inf), axis=0)
    used = sorted(set(choice.tolist()), key=lambda i: (-float(shapes[i] @ row_costs), i))
    remap = {old: new for new, old in enumerate(used)}
    return shapes[used], np.array([remap[c] for c in choice[inverse]], np.int32)


def best_fit_rows(lengths: Sequence[int], widths: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Rows (width, text indices) holding every text, best fit by decreasing length over rows of mixed widths.

    A text goes into the open row with the least room that still holds it; if none does, it opens a row
    of the smallest width in `widths` that holds it. Long texts get rows of their own size and short
    ones fill the gaps, so few tokens are padding and attention spans stay short.
    """
    import bisect

    widths = sorted(widths)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[tuple[int, list[int]]] = []
    free: list[tuple[int, int]] = []           # sorted (room, row index) of rows with room left
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            width = next((w for w in widths if w >= n), None)
            if width is None:
                raise PackingOverflow(f"a text of {n} tokens is longer than the widest row ({widths[-1]})")
            rows.append((width, []))
            room, r = width, len(rows) - 1
        rows[r][1].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


def pack_rows(tokens: Sequence[np.ndarray], rows: Sequence[Sequence[int]], shards: int, width: int, texts: int,
              pad_id: int, segments: int | None = None) -> tuple[dict, np.ndarray]:
    """Given rows (text indices into `tokens`), the packed arrays [S, ...] and the text in each slot.

    len(rows) is a multiple of `shards`; each shard has `texts` slots and each row `segments` (M; None:
    `segment_bound` of the fullest row). Returns (arrays, owners [S, texts]: the text index in each slot, -1
    where unused)."""
    per_shard = len(rows) // shards
    most = max((len(r) for r in rows), default=1)
    segments = segments or segment_bound(most)
    if most > segments:
        raise ValueError(f"a row holds {most} texts, more than its {segments} segment slots")
    out = {"ids": np.full((shards, per_shard, width), pad_id, np.int32),
           "mask": np.zeros((shards, per_shard, width), np.int32),
           "text": np.full((shards, per_shard, width), texts, np.int32),
           "first": np.zeros((shards, texts), np.int32), "last": np.zeros((shards, texts), np.int32),
           "segments": np.zeros((shards, per_shard, segments), np.int32)}
    owners = np.full((shards, texts), -1, np.int64)
    for s in range(shards):
        slot = 0
        for r in range(per_shard):
            col = 0
            for seg, i in enumerate(rows[s * per_shard + r], start=1):
                n = len(tokens[i])
                span = slice(col, col + n)
                out["ids"][s, r, span], out["mask"][s, r, span], out["text"][s, r, span] = tokens[i], seg, slot
                out["first"][s, slot], out["last"][s, slot] = r * width + col, r * width + col + n - 1
                out["segments"][s, r, seg - 1] = n
                owners[s, slot] = i
                slot, col = slot + 1, col + n
    return out, owners


def plan_calls(rows: Sequence[tuple[int, list[int]]], rows_per_call: dict[int, int],
               shards: int) -> list[tuple[int, list[list[int]]]]:
    """Group packed rows (width, text indices) into encoder calls (width, rows) of few static shapes.

    Every call of a width has ``rows_per_call[width]`` rows (a multiple of `shards`), widest first. The
    empty rows of a width's last call are filled with rows of narrower widths laid side by side (their
    widths sum to at most the call's width; the texts stay separate segments), so no call runs half
    empty while narrower texts wait. Only the very last call can be short: it gets the fewest rows, a
    power of two times `shards`, that hold what is left. Empty rows are ``[]``.
    """
    by_width: dict[int, list[list[int]]] = {}
    for width, texts in rows:
        by_width.setdefault(width, []).append(list(texts))
    widths = sorted(by_width, reverse=True)
    calls: list[tuple[int, list[list[int]]]] = []
    for i, width in enumerate(widths):
        mine, per_call = by_width[width], rows_per_call[width]
        if per_call % shards:
            raise ValueError(f"{per_call} rows per call of width {width} do not split over {shards} shards")
        full = len(mine) - len(mine) % per_call
        calls += [(width, mine[k:k + per_call]) for k in range(0, full, per_call)]
        tail = mine[full:]
        if not tail:
            continue
        narrower = widths[i + 1:]
        while len(tail) < per_call and any(by_width[w] for w in narrower):
            merged, room = [], width
            for w in narrower:                                   # widest first
                while by_width[w] and w <= room:
                    merged += by_width[w].pop()
                    room -= w
            tail.append(merged)
        if len(tail) < per_call:                                 # nothing narrower is left: the last call
            n = shards
            while n < len(tail):
                n *= 2
            tail += [[] for _ in range(min(n, per_call) - len(tail))]
        calls.append((width, tail))
    return calls
