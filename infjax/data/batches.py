"""Deterministic global batches of training rows, each host building only its slice.

The batch at a given step is a pure function of (seed, step): the record
order of epoch e is a permutation drawn from (seed, e), and the instruction
negatives of a step are drawn from (seed, step). The data-iterator position
is therefore just the step, which makes resuming exact.

A batch is padded (each text padded to its side's max length: `q_ids`,
`q_mask` [R, L] ...) or packed (data.packing: each side a dict of packed
arrays, `{"q": {"ids", "mask", "text", "first", "last", "segments"}, ...}`, one packing
per batch shard, or per gradient-caching chunk of one, see data/packing.py).
Packed buffers have fixed shapes, measured once before the first step over
every step of the run, or a sample of 512 spread over a longer one
(`measure_shapes`): per side a row length, the most texts a row holds (rounded
up to a power of two), and a few sets of row counts, each step packed into the
cheapest set that holds it (one compiled train step per set). A step outside
the sample is fitted as it is built, the shapes growing if none holds it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np

from infjax.data import packing
from infjax.data.inf_ir import flatten_record, flatten_record_no_hard_negatives
from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.errors import ConfigError

log = logging.getLogger("infjax.data")


def rows_per_record(hard_negatives: bool) -> int:
    return 3 if hard_negatives else 1


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Which records form the global batch of each step."""

    num_records: int
    batch_size: int          # records per global batch
    seed: int

    def __post_init__(self):
        if self.batch_size < 1:
            raise ConfigError(f"config.train.batch_size={self.batch_size}: must be >= 1")
        if self.num_records < self.batch_size:
            raise ConfigError(f"config.train.batch_size={self.batch_size}: the training data has only "
                              f"{self.num_records} records, fewer than one batch")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_records // self.batch_size   # the last partial batch of an epoch is dropped

    def position(self, step: int) -> dict[str, int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        return {"step": step, "epoch": epoch, "offset": offset}

    def record_indices(self, step: int) -> np.ndarray:
        pos = self.position(step)
        order = _epoch_order(self.seed, pos["epoch"], self.num_records)
        start = pos["offset"] * self.batch_size
        return order[start:start + self.batch_size]


@functools.lru_cache(maxsize=2)
def _epoch_order(seed: int, epoch: int, num_records: int) -> np.ndarray:
    """The record order of an epoch, drawn once (not at every step: a permutation of every record)."""
    order = np.random.default_rng([seed, epoch]).permutation(num_records)
    order.flags.writeable = False
    return order


class InstructionNegativeSampler:
    """K instruction negatives per row, drawn from the whole record pool (docs/method.md §1.5).

    The pool is the set of distinct instruction texts (I+ and I-) of all
    records; a row never gets an instruction whose text equals its own.
    Draws depend only on (seed, step), so every host draws the same.
    """

    def __init__(self, records: list[dict], k: int, seed: int):
        texts = dict.fromkeys(t for r in records for t in (r["instruction_positive"], r["instruction_negative"]))
        self.pool = list(texts)
        self.index = {t: i for i, t in enumerate(self.pool)}
        self.k, self.seed = k, seed
        if k < 0:
            raise ConfigError(f"config.loss.instruction_negatives={k}: must be >= 0")
        if k > len(self.pool) - 1:
            raise ConfigError(f"config.loss.instruction_negatives={k}: the data has only {len(self.pool)} distinct "
                              f"instructions ({len(self.pool) - 1} candidates per row)")

    def sample(self, step: int, instructions: list[str]) -> list[list[str]]:
        rng = np.random.default_rng([self.seed, 7, step])
        out = []
        for text in instructions:
            own = self.index[text]
            draw = rng.choice(len(self.pool) - 1, size=self.k, replace=False)
            draw = draw + (draw >= own)                      # skip the row's own instruction
            out.append([self.pool[j] for j in draw])
        return out


@dataclasses.dataclass
class BatchBuilder:
    """Turns a step into this host's slice of the global batch, as numpy arrays."""

    records: list[dict]
    plan: BatchPlan
    tokenizer: Tokenizer
    fmt: TextFormat
    query_max_len: int
    passage_max_len: int
    hard_negatives: bool = True
    sampler: InstructionNegativeSampler | None = None
    process_index: int = 0
    process_count: int = 1
    interaction: str = "concat"     # concat | cross_attention (instructions and queries encoded apart)
    capacities: dict[str, packing.Capacity] | None = None   # side -> packed capacity (None: padded batches)
    shapes: packing.Shapes | None = None          # several packed shapes, one per step (None: `capacities` always)
    shards: int = 1                 # batch shards of this process (packing packs each shard apart)
    capacity_keys: dict[str, str] | None = None   # side -> the config key that sets its rows (error messages)
    pack_lengths: dict[str, int] | None = None    # "query" / "passage" -> tokens per packed row (default max_len)
    chunks: dict[str, int] | None = None          # side -> gradient-caching chunks, each packed apart (None: off)
    fixed_sides: tuple[str, ...] = ()             # sides whose rows the config fixes (never fitted nor grown)

    @property
    def global_rows(self) -> int:
        return self.plan.batch_size * rows_per_record(self.hard_negatives)

    def rows(self, step: int) -> list[tuple[str, str, str]]:
        """All (instruction, query, passage) rows of the global batch, record-major."""
        flat = flatten_record if self.hard_negatives else flatten_record_no_hard_negatives
        return [row for i in self.plan.record_indices(step) for row in flat(self.records[i])]

    def local_slice(self) -> slice:
        n = self.global_rows // self.process_count
        return slice(self.process_index * n, (self.process_index + 1) * n)

    def max_len(self, side: str) -> int:
        return self.passage_max_len if side == "p" else self.query_max_len

    def pack_length(self, side: str) -> int:
        return (self.pack_lengths or {}).get("passage" if side == "p" else "query") or self.max_len(side)

    def side_texts(self, step: int, local: bool = True) -> tuple[dict[str, list[str]], np.ndarray | None]:
        """The encoder inputs of a step as texts: side -> texts in row order (this process's rows, or all
        with local=False), plus the instruction groups of Interaction II (None under Interaction I).

        Sides: "q" (template(I, Q)), "p" (passages), "n" (the K instruction negatives of each row,
        row-major) under Interaction I; "i" (instructions), "qo" (queries) and "p" under Interaction II.
        """
        rows = self.rows(step)
        sl = self.local_slice() if local else slice(None)
        if self.interaction == "cross_attention":
            text_ids = {t: i for i, t in enumerate(dict.fromkeys(r[0] for r in rows))}
            groups = np.array([text_ids[r[0]] for r in rows], np.int32)[sl]
            rows = rows[sl]
            return {"i": [self.fmt.alone(i) for i, _, _ in rows], "qo": [self.fmt.alone(q) for _, q, _ in rows],
                    "p": [self.fmt.passage(p) for _, _, p in rows]}, groups
        negatives = self.sampler.sample(step, [r[0] for r in rows]) if self.sampler and self.sampler.k else None
        rows = rows[sl]
        texts = {"q": [self.fmt.query(i, q) for i, q, _ in rows], "p": [self.fmt.passage(p) for _, _, p in rows]}
        if negatives is not None:
            texts["n"] = [self.fmt.query(ins, q) for (_, q, _), negs in zip(rows, negatives[sl]) for ins in negs]
        return texts, None

    def __call__(self, step: int) -> dict:
        texts, groups = self.side_texts(step)
        if self.capacities is not None:
            capacities = self.shapes.at(step) if self.shapes is not None else self.capacities
            tokens = {side: self.tokenizer.tokens(t, self.max_len(side)) for side, t in texts.items()}
            if capacities is None:               # a step the shapes were not measured over: fitted now
                capacities = self._fit(step, tokens)
            batch = {}
            for side, t in tokens.items():
                try:
                    batch[side] = packing.pack(t, self.shards, capacities[side], self.tokenizer.pad_id,
                                               f"step {step}, side {side!r}", (self.chunks or {}).get(side))
                except packing.PackingOverflow as e:
                    key = (self.capacity_keys or {}).get(side, "the packing capacity")
                    raise packing.PackingOverflow(f"{e}; raise {key} (0 = measured over the run)") from None
        else:
            batch = {}
            for side, t in texts.items():
                ids, mask = self.tokenizer(t, self.max_len(side))
                if side == "n":
                    ids, mask = (x.reshape(len(texts["q"]), self.sampler.k, -1) for x in (ids, mask))
                batch[f"{side}_ids"], batch[f"{side}_mask"] = ids, mask
        if groups is not None:
            batch["i_group"] = groups
        return batch

    def _fit(self, step: int, local_tokens: dict[str, list[np.ndarray]]) -> dict[str, packing.Capacity]:
        """The capacities of a step that was not measured, from the token counts of its whole global batch (every
        process counts the same texts, so all choose, and grow, alike); a shape that grows is logged once."""
        if self.process_count == 1:
            counts = {side: [len(t) for t in tokens] for side, tokens in local_tokens.items()}
        else:
            texts, _ = self.side_texts(step, local=False)
            counts = {side: [len(t) for t in self.tokenizer.tokens(t, self.max_len(side))]
                      for side, t in texts.items()}
        counts = {side: c for side, c in counts.items() if side not in (self.fixed_sides or ())}
        shapes, capacities, note = self.shapes.fit(counts, self.shards * self.process_count, self.chunks)
        if note is not None:
            log.warning("packing: step %d does not fit the shapes measured over %d sampled steps: %s (compiled "
                        "once more)", step, len(self.shapes.measured()), note)
            self.shapes, self.capacities = shapes, shapes.capacities(shapes.largest)
        return capacities


def real_tokens(batch: dict) -> int:
    """The real (not padding) tokens of a batch as `BatchBuilder` returns it, padded or packed: the non-zero
    entries of its masks (0/1 when padded, segment ids when packed). Host numpy, no device involved."""
    total = 0
    for key, value in batch.items():
        if isinstance(value, dict):
            total += real_tokens(value)
        elif key == "mask" or key.endswith("_mask"):
            total += int(np.count_nonzero(value))
    return total


# Steps over which the packed shapes are measured at most: a run of more is measured over this many spread evenly
# over it (each further step is fitted when it is built, BatchBuilder._fit), so the time before the first step
# and the memory the measurement takes do not grow with the data.
MEASURED_STEPS = 512


def sampled_steps(steps: range, most: int) -> np.ndarray:
    """Every step of `steps` if there are at most `most`, else `most` of them spread evenly from the first to
    the last (a pure function of the range, so every process measures the same steps)."""
    if len(steps) <= most:
        return np.array(steps, np.int64)
    return np.unique(np.asarray(steps, np.int64)[np.linspace(0, len(steps) - 1, most).round().astype(np.int64)])


def measure_shapes(build: BatchBuilder, steps: range, shards: int, max_shapes: int = 1,
                   fixed_rows: dict[str, int] | None = None, min_gain: float = 0.0,
                   span: float = packing.ATTENTION_SPAN, multiple: int = packing.LENGTH_STEP,
                   most: int | None = None) -> packing.Shapes:
    """The packed shapes of the steps listed, measured over `sampled_steps` of them (at most `most`, default
    MEASURED_STEPS): per side a
    row length and up to `max_shapes` sets of row counts per batch shard (or per chunk of one under gradient
    caching), each measured step in its cheapest set. A step not measured is fitted when it is built
    (``packing.Shapes.fit``), growing the shapes if none holds it; when the steps are sampled, the set of the most
    rows has one row more per measured side than the sample needs, so that few steps do.

    The row length is the side's configured pack length, else the one of least cost over the first steps
    (``packing.choose_length``: a multiple of 32 from the longest text of the side over the measured steps;
    `span`: the attention cost model, ``packing.row_cost``; `multiple`: what row lengths must be a multiple of
    for the platform's attention kernel). `fixed_rows` (side -> rows, from the config) are not
    measured: those sides keep those rows in every shape. Every process measures the global batches, so all
    agree on the shapes. Texts are tokenized once each.
    """
    fixed_rows = fixed_rows or {}
    measured = sampled_steps(steps, most or MEASURED_STEPS)
    if len(measured) < len(steps):
        log.info("packing: measuring the packed shapes over %d of the run's %d steps (the others are fitted as "
                 "they are built)", len(measured), len(steps))
    lengths_of: dict[tuple[str, str], int] = {}
    per_step: dict[str, list[list[int]]] = {}
    for step in measured.tolist():
        texts, _ = build.side_texts(step, local=False)
        if set(texts) <= set(fixed_rows):          # every side's rows are fixed: nothing to measure
            per_step = {side: [] for side in texts}
            break
        for side, batch_texts in texts.items():
            if side in fixed_rows:
                per_step.setdefault(side, [])
                continue
            new = [t for t in dict.fromkeys(batch_texts) if (side, t) not in lengths_of]
            for t, ids in zip(new, build.tokenizer.tokens(new, build.max_len(side))):
                lengths_of[(side, t)] = len(ids)
            per_step.setdefault(side, []).append([lengths_of[(side, t)] for t in batch_texts])
    sides = sorted(per_step)
    lengths, needs, texts = {}, [], {}
    for side in sides:
        chunks = (build.chunks or {}).get(side, 1)
        configured = (build.pack_lengths or {}).get("passage" if side == "p" else "query")
        if side in fixed_rows:
            lengths[side] = build.pack_length(side)
            needs.append(np.full(len(measured), fixed_rows[side]))     # (nothing measured: all steps alike)
            continue
        lengths[side] = configured or packing.choose_length(per_step[side], shards, chunks, span, multiple)
        fills = [packing.capacity_for([step], shards, lengths[side], chunks) for step in per_step[side]]
        needs.append(np.array([c.rows for c in fills]))
        texts[side] = packing.segment_bound(max(c.texts for c in fills))
    needs = np.stack(needs, axis=1).reshape(len(measured), len(sides))
    costs = np.array([packing.row_cost(lengths[side], span) for side in sides])
    shapes, of_step = packing.choose_shapes(needs, costs, max_shapes, min_gain)
    most = needs.max(axis=0)
    if len(measured) < len(steps):        # a sample: the shape of the most rows gets a row more per measured side
        # (never more rows than a shard's texts), so that a step a little above the sample's most compiles no more
        bound = [len(per_step[side][0]) // shards // (build.chunks or {}).get(side, 1) if side not in fixed_rows
                 else fixed_rows[side] for side in sides]
        bump = np.minimum(most + np.array([side not in fixed_rows for side in sides]), bound) - most
        shapes = np.where(np.all(shapes == most, axis=1)[:, None], shapes + bump, shapes)
        most = most + bump
    as_dict = lambda row: {side: int(n) for side, n in zip(sides, row)}    # noqa: E731
    return packing.Shapes(lengths, tuple(as_dict(r) for r in shapes), of_step, as_dict(most), texts,
                          measured, span, multiple)
