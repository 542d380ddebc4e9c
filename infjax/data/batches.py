"""Assemble a step: this process's slice of the global batch, as numpy arrays, from the token store.

A step's batch is a pure function of (seed, step): the record order of epoch
e is a permutation drawn from (seed, e) (`BatchPlan`), and the instruction
negatives of a step are drawn from (seed, step)
(`InstructionNegativeSampler`). The data-iterator position is therefore just
the step, which makes resuming exact, and any worker can build any step
(data/prefetch.py builds them ahead of the loop).

It reads in two stages. `StepTexts` says which texts each encoder input of a
step holds, as ids assembled from data/token_store.py, not tokenized: an
instruction-aware query is the special tokens, the template's constant ids
and its two fields' ids, cut at query_max_len, as the tokenizer makes the
whole text (checked on every query of the data when the store was built).
Where that does not hold (`TokenStore.exact` False), each step's texts are
tokenized as the step is built (per-step tokenization). `BatchBuilder` then
lays those texts out: padded (each text padded to its side's max length:
`q_ids`, `q_mask` [R, L] ...), or packed (data.packing: each side a dict of
packed arrays, `{"q": {"ids", "mask", "text", "first", "last", "segments"},
...}`, one packing per batch shard, or per gradient-caching chunk of one, see
data/packing.py) in the shapes of its `Packing`.

Packed buffers have fixed shapes, measured once before the first step over
every step of the run, or a sample of 512 spread over a longer one
(`measure_shapes`): per side a row length, the most texts a row holds (rounded
up to a power of two), and a few sets of row counts, each step packed into the
cheapest set that holds it (one compiled train step per set). A step outside
the sample is fitted as it is built, from the measured shapes alone (so that
it is the same whoever builds it, whatever was built before), a further shape
where none holds it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import numpy as np

from infjax.data import packing
from infjax.data.token_store import FIELDS, I_NEG, I_POS, P_NEG1, P_NEG2, P_POS, Q_NEG, Q_POS, TokenStore
from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.errors import ConfigError

log = logging.getLogger("infjax.data")

# The three rows of a record, in order: (I+, Q+, P+), (I-, Q+, P1-), (I+, Q-, P2-) (docs/method.md §1.1); the
# field of each row's instruction, query and passage, and which of the record's instructions (0: I+, 1: I-).
ROW_INSTRUCTION = np.array([I_POS, I_NEG, I_POS])
ROW_QUERY = np.array([Q_POS, Q_POS, Q_NEG])
ROW_PASSAGE = np.array([P_POS, P_NEG1, P_NEG2])
ROW_OWN = np.array([0, 1, 0])


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

    The pool is the set of distinct instruction texts (I+ and I-) of all records (`TokenStore.pool`); a row
    never gets an instruction whose text equals its own. The draws of a step are one generator's, seeded by
    (seed, step), for every row of the global batch at once (Floyd's algorithm, vectorized over rows: each
    row gets K distinct instructions, every K-subset equally likely), so every host draws the same at a cost
    that does not grow with the number of hosts.
    """

    def __init__(self, pool_size: int, k: int, seed: int):
        self.pool_size, self.k, self.seed = pool_size, k, seed
        if k < 0:
            raise ConfigError(f"config.loss.instruction_negatives={k}: must be >= 0")
        if k > pool_size - 1:
            raise ConfigError(f"config.loss.instruction_negatives={k}: the data has only {pool_size} distinct "
                              f"instructions ({pool_size - 1} candidates per row)")

    def draw(self, step: int, own: np.ndarray) -> np.ndarray:
        """[rows, K] pool indices for rows whose own instructions are the pool indices `own` [rows]."""
        rng = np.random.default_rng([self.seed, 7, step])
        rows, k, candidates = len(own), self.k, self.pool_size - 1
        out = np.zeros((rows, k), np.int64)
        for j in range(k):                            # Floyd: t in [0, hi]; a value drawn before stands for hi
            hi = candidates - k + j
            t = rng.integers(0, hi + 1, size=rows)
            taken = (out[:, :j] == t[:, None]).any(axis=1)
            out[:, j] = np.where(taken, hi, t)
        return out + (out >= np.asarray(own)[:, None])     # skip the row's own instruction


@dataclasses.dataclass(frozen=True)
class Texts:
    """The records as text, for what needs the texts themselves.

    That is a store whose ids cannot be assembled (`TokenStore.exact` False: per-step tokenization), and
    `StepTexts.side_texts`."""

    records: Sequence[dict]          # the training records (as `TokenStore` numbers them)
    tokenizer: Tokenizer
    fmt: TextFormat


@dataclasses.dataclass
class Side:
    """The texts of one encoder input of a step: every text's ids one after another, and their lengths."""

    flat: np.ndarray                 # int32 ids
    lengths: np.ndarray              # [T] int64
    cut: np.ndarray | None = None    # [T] bool: the text was longer than its max length (None: not known)


@dataclasses.dataclass(frozen=True)
class StepTexts:
    """Which texts each encoder input of a step holds: this process's (or all) texts, as ids or as text.

    Sides: "q" (template(I, Q)), "p" (passages), "n" (the K instruction negatives of each row, row-major)
    under Interaction I; "i" (instructions), "qo" (queries) and "p" under Interaction II.
    """

    store: TokenStore
    plan: BatchPlan
    query_max_len: int
    passage_max_len: int
    hard_negatives: bool = True
    sampler: InstructionNegativeSampler | None = None
    process_index: int = 0
    process_count: int = 1
    interaction: str = "concat"     # concat | cross_attention (instructions and queries encoded apart)
    texts: Texts | None = None      # the records as text (required when the store is not exact)
    text_keys: bool = False         # add each row's text identities (`text_keys_of`: loss.mask_duplicates)

    def __post_init__(self):
        made = self.store.meta["encoding"]
        if (made["query_max_len"], made["passage_max_len"]) != (self.query_max_len, self.passage_max_len):
            raise ValueError(f"the token store was made for max lengths {made['query_max_len']}/"
                             f"{made['passage_max_len']}, the builder asks for {self.query_max_len}/"
                             f"{self.passage_max_len}")
        if not self.store.exact and self.texts is None:
            raise ValueError("a token store whose ids cannot be assembled needs the records as text (texts=)")

    @property
    def global_rows(self) -> int:
        return self.plan.batch_size * rows_per_record(self.hard_negatives)

    def local_slice(self) -> slice:
        n = self.global_rows // self.process_count
        return slice(self.process_index * n, (self.process_index + 1) * n)

    def max_len(self, side: str) -> int:
        return self.passage_max_len if side == "p" else self.query_max_len

    def sides(self) -> tuple[str, ...]:
        if self.interaction == "cross_attention":
            return ("i", "qo", "p")
        return ("q", "p", "n") if self.sampler is not None and self.sampler.k else ("q", "p")

    @property
    def pad_id(self) -> int:
        """The id padding takes: the store's, or the tokenizer's where each step is tokenized."""
        return self.store.pad_id if self.store.exact else self._text().tokenizer.pad_id

    # --- which texts a step holds
    def _rows(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The global batch's rows: (training record, row kind 0/1/2, own instruction's pool index), record-major."""
        per = rows_per_record(self.hard_negatives)
        records = np.asarray(self.plan.record_indices(step), np.int64)
        record = np.repeat(records, per)
        kind = np.tile(np.arange(per), len(records))
        own = np.asarray(self.store.own[record, ROW_OWN[kind]], np.int64)
        return record, kind, own

    def _negatives(self, step: int, own: np.ndarray) -> np.ndarray | None:
        if self.interaction == "cross_attention" or self.sampler is None or not self.sampler.k:
            return None
        return self.sampler.draw(step, own)

    def groups(self, own: np.ndarray) -> np.ndarray:
        """Interaction II: each row's instruction as a group id, numbered by first occurrence in the batch."""
        return _first_numbered(np.asarray(own)[:, None])

    def rows(self, step: int) -> list[tuple[str, str, str]]:
        """All (instruction, query, passage) rows of the global batch as text, record-major."""
        records = self._text().records
        record, kind, _ = self._rows(step)
        out = []
        for r, k in zip(record.tolist(), kind.tolist()):
            rec = records[r]
            out.append((rec[FIELDS[ROW_INSTRUCTION[k]]], rec[FIELDS[ROW_QUERY[k]]], rec[FIELDS[ROW_PASSAGE[k]]]))
        return out

    def _text(self) -> Texts:
        if self.texts is None:
            raise ValueError("this builder was made without the records as text (texts=)")
        return self.texts

    def side_texts(self, step: int, local: bool = True) -> tuple[dict[str, list[str]], np.ndarray | None]:
        """The encoder inputs of a step as texts: side -> texts in row order, and the groups of Interaction II.

        This process's rows, or all with local=False; the groups are None under Interaction I.
        """
        text = self._text()
        fmt, records = text.fmt, text.records
        rows = self.rows(step)
        record, kind, own = self._rows(step)
        sl = self.local_slice() if local else slice(None)
        if self.interaction == "cross_attention":
            rows = rows[sl]
            return {"i": [fmt.alone(i) for i, _, _ in rows], "qo": [fmt.alone(q) for _, q, _ in rows],
                    "p": [fmt.passage(p) for _, _, p in rows]}, self.groups(own)[sl]
        negatives = self._negatives(step, own)
        rows = rows[sl]
        texts = {"q": [fmt.query(i, q) for i, q, _ in rows], "p": [fmt.passage(p) for _, _, p in rows]}
        if negatives is not None:
            pool = np.asarray(self.store.pool)
            texts["n"] = [fmt.query(records[int(pool[j]) // 7][FIELDS[int(pool[j]) % 7]], q)
                          for (_, q, _), draws in zip(rows, negatives[sl]) for j in draws]
        return texts, None

    def data_cuts(self) -> dict[str, tuple[int, int]]:
        """side -> (texts its max length cuts, texts) over the rows of every training record, each once.

        The instruction-aware queries ("q"; Interaction II: "i" and "qo") and the passages ("p"), not the drawn
        instruction negatives. Read off the store's uncut lengths: nothing is tokenized. A store whose queries
        are not assembled from their fields' ids (`TokenStore.exact`) counts its passages only.
        """
        per = rows_per_record(self.hard_negatives)
        store_rows = np.repeat(np.asarray(self.store.kept, np.int64), per)
        kind = np.tile(np.arange(per), len(self.store.kept))
        assemble = functools.partial(assemble_texts, self.store, ids=False)
        sides = {"p": assemble([(store_rows, ROW_PASSAGE[kind])])}
        if self.store.exact and self.interaction == "cross_attention":
            sides.update(i=assemble([(store_rows, ROW_INSTRUCTION[kind])]),
                         qo=assemble([(store_rows, ROW_QUERY[kind])]))
        elif self.store.exact:
            sides["q"] = self._queries(store_rows, ROW_INSTRUCTION[kind], store_rows, ROW_QUERY[kind], ids=False)
        return {side: (int(np.count_nonzero(v.cut)), len(v.cut)) for side, v in sides.items()}

    def text_keys_of(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows' text identities over the global batch, for the loss's false negatives.

        "p_text" [R_local] int32: equal for two rows of the global batch whose passages are the same text (the
        same whole token ids); "iq_text": the same for their instruction-aware queries (instruction and query
        alike); under Interaction I with instruction negatives, "n_same" [R_local, K] int32: 1 where a drawn
        instruction is the row's own instruction by text. Numbered by first occurrence in the global batch, so
        every process numbers alike."""
        record, kind, own = self._rows(step)
        rows = np.asarray(self.store.kept[record], np.int64)
        key = lambda fields: np.asarray(self.store.text_key[rows, fields])   # noqa: E731
        i_key, q_key = key(ROW_INSTRUCTION[kind]), key(ROW_QUERY[kind])
        sl = self.local_slice()
        out = {"p_text": _first_numbered(key(ROW_PASSAGE[kind])[:, None])[sl],
               "iq_text": _first_numbered(np.stack([i_key, q_key], axis=1))[sl]}
        negatives = self._negatives(step, own)
        if negatives is not None:
            pool = np.asarray(self.store.pool[negatives[sl].reshape(-1)], np.int64)
            drawn = np.asarray(self.store.text_key[np.asarray(self.store.kept[pool // 7], np.int64), pool % 7])
            out["n_same"] = (drawn.reshape(negatives[sl].shape) == i_key[sl, None]).astype(np.int32)
        return out

    # --- the ids of a step's texts
    def side_ids(self, step: int, local: bool = True) -> tuple[dict[str, Side], np.ndarray | None]:
        """The encoder inputs of a step as ids: side -> `Side` (texts in `side_texts`' order), and the groups.

        The groups are Interaction II's (None under Interaction I)."""
        return self._sides(step, local, ids=True)

    def side_lengths(self, step: int, local: bool = True) -> dict[str, np.ndarray]:
        """side -> the token count of each text of a step (in `side_texts`' order): what packing measures."""
        return {side: v.lengths for side, v in self._sides(step, local, ids=False)[0].items()}

    def _sides(self, step: int, local: bool, ids: bool) -> tuple[dict[str, Side], np.ndarray | None]:
        """`side_ids`, or with ids=False only the lengths (and what was cut) of each side."""
        if not self.store.exact:
            return self._tokenized(step, local)
        record, kind, own = self._rows(step)
        sl = self.local_slice() if local else slice(None)
        groups = self.groups(own)[sl] if self.interaction == "cross_attention" else None
        negatives = self._negatives(step, own)
        store_rows = np.asarray(self.store.kept[record[sl]], np.int64)
        kind = kind[sl]
        assemble = functools.partial(assemble_texts, self.store, ids=ids)
        if self.interaction == "cross_attention":
            return {"i": assemble([(store_rows, ROW_INSTRUCTION[kind])]),
                    "qo": assemble([(store_rows, ROW_QUERY[kind])]),
                    "p": assemble([(store_rows, ROW_PASSAGE[kind])])}, groups
        out = {"q": self._queries(store_rows, ROW_INSTRUCTION[kind], store_rows, ROW_QUERY[kind], ids),
               "p": assemble([(store_rows, ROW_PASSAGE[kind])])}
        if negatives is not None:
            pool = np.asarray(self.store.pool[negatives[sl].reshape(-1)], np.int64)       # row-major, K per row
            k = negatives.shape[1]
            out["n"] = self._queries(np.asarray(self.store.kept[pool // 7], np.int64), pool % 7,
                                     np.repeat(store_rows, k), np.repeat(ROW_QUERY[kind], k), ids)
        return out, groups

    def _queries(self, i_rows, i_fields, q_rows, q_fields, ids: bool) -> Side:
        """template(I, Q) of each (instruction piece, query piece): constants and fields in the template's order."""
        by_role = {"instruction": (i_rows, i_fields), "query": (q_rows, q_fields)}
        first, second = (by_role[name] for name in self.store.meta["query_order"])
        return assemble_texts(self.store, [first, second], ids=ids, constants=True)

    def _tokenized(self, step: int, local: bool) -> tuple[dict[str, Side], np.ndarray | None]:
        """A step's ids by per-step tokenization: its texts tokenized now (a store whose ids cannot be assembled)."""
        texts, groups = self.side_texts(step, local)
        tokenizer = self._text().tokenizer
        out = {}
        for side, t in texts.items():
            tokens = tokenizer.tokens(t, self.max_len(side))
            lengths = np.fromiter((len(x) for x in tokens), np.int64, len(tokens))
            out[side] = Side(np.concatenate(tokens).astype(np.int32) if tokens else np.zeros(0, np.int32), lengths)
        return out, groups


@dataclasses.dataclass(frozen=True)
class Packing:
    """How the texts of each side are packed (data.packing): the run's shapes, and where each packing applies.

    Made once before the first step (`measure_shapes`); a step gets the shape it was measured in, or one fitted
    when it is built (`BatchBuilder._fit`).
    """

    shapes: packing.Shapes          # row lengths, the sets of row counts, the shape of each measured step
    shards: int = 1                 # batch shards of this process: each packs its own texts
    chunks: dict[str, int] | None = None     # side -> gradient-caching chunks, each packed apart (None: off)
    row_keys: dict[str, str] | None = None   # side -> the config key that sets its rows (named on an overflow)
    fixed_sides: tuple[str, ...] = ()        # sides whose rows the config fixes (never fitted nor grown)

    @property
    def capacities(self) -> dict[str, packing.Capacity]:
        """Each side's capacity in the widest shape, which holds every measured step."""
        return self.shapes.capacities(self.shapes.largest)


@dataclasses.dataclass(frozen=True)
class BatchBuilder:
    """A step -> this process's slice of the global batch, as numpy arrays: its texts, padded or packed."""

    step_texts: StepTexts
    packing: Packing | None = None  # None: padded batches
    padding_side: str = "right"     # padded batches: where the pad ids go (decoders: left)

    # --- what the loop reads of the texts
    @property
    def global_rows(self) -> int:
        return self.step_texts.global_rows

    def max_len(self, side: str) -> int:
        return self.step_texts.max_len(side)

    def data_cuts(self) -> dict[str, tuple[int, int]]:
        return self.step_texts.data_cuts()

    # --- the batch
    def __call__(self, step: int) -> dict:
        return self.assemble(step)[0]

    def assemble(self, step: int) -> tuple[dict, dict]:
        """(this process's batch of `step`, what the loop reports of it).

        The report: {"texts": {side: n}, "cut": {side: n} (texts longer than their max length; absent where not
        known), "grown": a note when the step needed a shape the measurement did not give, else None, "source":
        the step's source under a one-source mixture, else None}.
        """
        sides, groups = self.step_texts.side_ids(step)
        source_of = getattr(self.step_texts.plan, "source_of", None)      # a mixture's, one source per batch
        info = {"texts": {s: len(v.lengths) for s, v in sides.items()},
                "cut": {s: int(v.cut.sum()) for s, v in sides.items() if v.cut is not None}, "grown": None,
                "source": source_of(step) if source_of is not None else None}
        pad = self.step_texts.pad_id
        batch = {}
        if self.packing is not None:
            capacities = self.packing.shapes.at(step)
            if capacities is None:               # a step the shapes were not measured over: fitted now
                capacities, info["grown"] = self._fit(step, sides)
            chunks = self.packing.chunks or {}
            for side, v in sides.items():
                try:
                    batch[side] = packing.pack_flat(v.flat, v.lengths, self.packing.shards, capacities[side], pad,
                                                    f"step {step}, side {side!r}", chunks.get(side))
                except packing.PackingOverflow as e:
                    key = (self.packing.row_keys or {}).get(side, "the packing capacity")
                    raise packing.PackingOverflow(f"{e}; raise {key} (0 = measured over the run)") from None
        else:
            for side, v in sides.items():
                ids, mask = packing.pad_flat(v.flat, v.lengths, self.max_len(side), pad, self.padding_side == "left")
                if side == "n":
                    ids, mask = (x.reshape(len(sides["q"].lengths), self.step_texts.sampler.k, -1) for x in (ids, mask))
                batch[f"{side}_ids"], batch[f"{side}_mask"] = ids, mask
        if groups is not None:
            batch["i_group"] = groups
        if self.step_texts.text_keys:
            batch.update(self.step_texts.text_keys_of(step))
        return batch, info

    def _fit(self, step: int, local: dict[str, Side]) -> tuple[dict[str, packing.Capacity], str | None]:
        """The capacities of a step that was not measured, and a note when the measured shapes do not hold it.

        Counted over the step's whole global batch (every process counts the same texts, so all choose alike);
        a pure function of the step and the measured shapes. The note is None when a measured shape holds it.
        """
        texts, packed = self.step_texts, self.packing
        if texts.process_count == 1:
            counts = {side: v.lengths for side, v in local.items()}
        else:
            counts = texts.side_lengths(step, local=False)
        counts = {side: c.tolist() for side, c in counts.items() if side not in packed.fixed_sides}
        shapes, capacities, note = packed.shapes.fit(counts, packed.shards * texts.process_count, packed.chunks)
        if note is not None:
            note = (f"packing: step {step} does not fit the shapes measured over {len(packed.shapes.measured())} "
                    f"sampled steps: {note} (compiled once more)")
        return capacities, note


def _first_numbered(keys: np.ndarray) -> np.ndarray:
    """Rows of `keys` [n, k] numbered 0, 1, ... by first occurrence, equal rows alike: [n] int32."""
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(first), np.int32)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=np.int32)
    return rank[np.asarray(inverse).reshape(-1)]


def assemble_texts(store: TokenStore, pieces: list[tuple[np.ndarray, np.ndarray]], ids: bool = True,
                   constants: bool = False) -> Side:
    """Texts made of store pieces, as one array of all their ids and their lengths (ids=False: the lengths).

    Each text is the special tokens around the concatenation of its pieces (`pieces`: one (clean records,
    fields) pair per piece, arrays of one length), with the template's constant ids around and between them
    (`constants`: head, piece, middle, piece, tail), cut at its side's length."""
    table = _constants_table(store) if constants else {}
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []     # (start, kept length, uncut length) per segment
    count = len(pieces[0][0])
    n_store = len(store.tokens)

    def constant(name: str) -> None:
        if table[name][1]:           # addressed past the store's ids: `n_store + offset` in the table
            offset, length = table[name]
            parts.append((np.full(count, n_store + offset, np.int64), np.full(count, length, np.int64),
                          np.full(count, length, np.int64)))

    for n, (records, fields) in enumerate(pieces):
        if constants:
            constant(("head", "middle")[n])
        records, fields = np.asarray(records, np.int64), np.asarray(fields, np.int64)
        parts.append((store.starts(records, fields), np.asarray(store.length[records, fields], np.int64),
                      np.asarray(store.uncut[records, fields], np.int64)))
    if constants:
        constant("tail")
    cap = store.cap(int(np.asarray(pieces[0][1]).reshape(-1)[0]) if count else 0)
    kept = np.stack([p[1] for p in parts], axis=1)                      # [T, S]
    before = np.cumsum(kept, axis=1) - kept
    kept = np.clip(cap - before, 0, kept)
    uncut = sum(p[2] for p in parts)
    pre, post = store.pre, store.post
    lengths = kept.sum(axis=1) + len(pre) + len(post)
    cut = uncut > cap
    if not ids:
        return Side(np.zeros(0, np.int32), lengths, cut)
    starts = np.stack([p[0] for p in parts], axis=1)                    # [T, S]
    seg_len = kept.reshape(-1)
    total = int(seg_len.sum())
    seg_out = np.cumsum(seg_len) - seg_len                              # where each segment lands in `content`
    src = np.repeat(starts.reshape(-1) - seg_out, seg_len) + np.arange(total)
    if table and src.size and src.max() >= n_store:
        content = np.empty(total, np.int32)
        inside = src < n_store
        content[inside] = store.tokens[src[inside]]
        content[~inside] = np.asarray(store.constants["head"] + store.constants["middle"] + store.constants["tail"],
                                      np.int32)[src[~inside] - n_store]
    else:
        content = np.asarray(store.tokens[src], np.int32)
    if not pre and not post:
        return Side(content, lengths, cut)
    flat = np.empty(int(lengths.sum()), np.int32)
    text_start = np.cumsum(lengths) - lengths
    body = kept.sum(axis=1)
    for j, token in enumerate(pre):
        flat[text_start + j] = token
    for j, token in enumerate(post):
        flat[text_start + len(pre) + body + j] = token
    inside = np.repeat(text_start + len(pre) - (np.cumsum(body) - body), body) + np.arange(total)
    flat[inside] = content
    return Side(flat, lengths, cut)


def _constants_table(store: TokenStore) -> dict[str, tuple[int, int]]:
    """name -> (offset, length) of the template's constants in head + middle + tail."""
    c = store.constants
    return {"head": (0, len(c["head"])), "middle": (len(c["head"]), len(c["middle"])),
            "tail": (len(c["head"]) + len(c["middle"]), len(c["tail"]))}


def real_tokens(batch: dict) -> int:
    """The real (not padding) tokens of a batch as `BatchBuilder` returns it, padded or packed.

    They are the non-zero entries of its masks (0/1 when padded, segment ids when packed). Host numpy, no
    device involved."""
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
    """Every step of `steps` if there are at most `most`, else `most` of them spread evenly over the range.

    From the first to the last, a pure function of the range: every process measures the same steps."""
    if len(steps) <= most:
        return np.array(steps, np.int64)
    return np.unique(np.asarray(steps, np.int64)[np.linspace(0, len(steps) - 1, most).round().astype(np.int64)])


def measure_shapes(texts: StepTexts, steps: range, shards: int, max_shapes: int = 1,
                   fixed_rows: dict[str, int] | None = None, min_gain: float = 0.0,
                   span: float = packing.ATTENTION_SPAN, multiple: int = packing.LENGTH_STEP,
                   most: int | None = None, *, chunks: dict[str, int] | None = None,
                   pack_lengths: dict[str, int] | None = None) -> packing.Shapes:
    """The packed shapes of the steps listed, measured over `sampled_steps` of them.

    At most `most` steps are measured (default MEASURED_STEPS). Per side a row length and up to `max_shapes` sets of row
    counts per batch shard (`shards` over all processes; or per chunk of one under gradient caching: `chunks`, side ->
    chunks), each measured step in its cheapest set. A step not measured is fitted when it is built
    (``packing.Shapes.fit``), growing the shapes if none holds it; when the steps are sampled, the set of the most rows
    has one row more per measured side than the sample needs, so that few steps do.

    The row length is the side's configured pack length (`pack_lengths`: "query" / "passage" -> tokens, 0 or
    absent: not configured), else the one of least cost over the first steps (``packing.choose_length``: a
    multiple of 32 from the longest text of the side over the measured steps; `span`: the attention cost
    model, ``packing.row_cost``; `multiple`: what row lengths must be a multiple of for the platform's
    attention kernel). `fixed_rows` (side -> rows, from the config) are not measured: those sides keep those
    rows in every shape, at the configured pack length or their max length. Every process measures the global
    batches, so all agree on the shapes. The lengths come from the token store (no text is tokenized).
    """
    fixed_rows, chunks, pack_lengths = fixed_rows or {}, chunks or {}, pack_lengths or {}
    measured = sampled_steps(steps, most or MEASURED_STEPS)
    log.info("packing: measuring the packed shapes over %d of the run's %d steps%s", len(measured), len(steps),
             " (the others are fitted as they are built)" if len(measured) < len(steps) else "")
    per_step: dict[str, list[list[int]]] = {side: [] for side in texts.sides()}
    if not set(texts.sides()) <= set(fixed_rows):          # else every side's rows are fixed: nothing to measure
        for step in measured.tolist():
            for side, n in texts.side_lengths(step, local=False).items():
                if side not in fixed_rows:
                    per_step[side].append(n.tolist())
    sides = sorted(per_step)
    lengths, needs, most_texts = {}, [], {}
    for side in sides:
        configured = pack_lengths.get("passage" if side == "p" else "query")
        if side in fixed_rows:
            lengths[side] = configured or texts.max_len(side)
            needs.append(np.full(len(measured), fixed_rows[side]))     # (nothing measured: all steps alike)
            continue
        lengths[side] = configured or packing.choose_length(per_step[side], shards, chunks.get(side, 1), span,
                                                            multiple)
        fills = [packing.capacity_for([step], shards, lengths[side], chunks.get(side, 1)) for step in per_step[side]]
        needs.append(np.array([c.rows for c in fills]))
        most_texts[side] = packing.segment_bound(max(c.texts for c in fills))
    needs = np.stack(needs, axis=1).reshape(len(measured), len(sides))
    costs = np.array([packing.row_cost(lengths[side], span) for side in sides])
    shapes, of_step = packing.choose_shapes(needs, costs, max_shapes, min_gain)
    most = needs.max(axis=0)
    if len(measured) < len(steps):        # a sample: the shape of the most rows gets a row more per measured side
        # (never more rows than a shard's texts), so that a step a little above the sample's most compiles no more
        bound = [len(per_step[side][0]) // shards // chunks.get(side, 1) if side not in fixed_rows
                 else fixed_rows[side] for side in sides]
        bump = np.minimum(most + np.array([side not in fixed_rows for side in sides]), bound) - most
        shapes = np.where(np.all(shapes == most, axis=1)[:, None], shapes + bump, shapes)
        most = most + bump
    as_dict = lambda row: {side: int(n) for side, n in zip(sides, row)}    # noqa: E731
    return packing.Shapes(lengths, tuple(as_dict(r) for r in shapes), of_step, as_dict(most), most_texts,
                          measured, span, multiple)
