"""Deterministic global batches of training rows, each host building only its slice.

The batch at a given step is a pure function of (seed, step): the record
order of epoch e is a permutation drawn from (seed, e), and the instruction
negatives of a step are drawn from (seed, step). The data-iterator position
is therefore just the step, which makes resuming exact.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from infjax.data.inf_ir import flatten_record, flatten_record_no_hard_negatives
from infjax.data.tokenize import TextFormat, Tokenizer


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
            raise ValueError(f"train.batch_size must be >= 1, got {self.batch_size}")
        if self.num_records < self.batch_size:
            raise ValueError(f"the training data has {self.num_records} records, fewer than one batch "
                             f"(train.batch_size={self.batch_size})")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_records // self.batch_size   # the last partial batch of an epoch is dropped

    def position(self, step: int) -> dict[str, int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        return {"step": step, "epoch": epoch, "offset": offset}

    def record_indices(self, step: int) -> np.ndarray:
        pos = self.position(step)
        order = np.random.default_rng([self.seed, pos["epoch"]]).permutation(self.num_records)
        start = pos["offset"] * self.batch_size
        return order[start:start + self.batch_size]


class InstructionNegativeSampler:
    """K instruction negatives per row, drawn from the whole record pool (SPEC §1.4).

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
            raise ValueError(f"loss.instruction_negatives must be >= 0, got {k}")
        if k > len(self.pool) - 1:
            raise ValueError(f"loss.instruction_negatives={k} but the data has only {len(self.pool)} distinct "
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

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        rows = self.rows(step)
        if self.interaction == "cross_attention":
            return self._cross_attention_batch(rows)
        negatives = self.sampler.sample(step, [r[0] for r in rows]) if self.sampler and self.sampler.k else None
        sl = self.local_slice()
        rows = rows[sl]
        q_ids, q_mask = self.tokenizer([self.fmt.query(i, q) for i, q, _ in rows], self.query_max_len)
        batch = {"q_ids": q_ids, "q_mask": q_mask, **self._passages(rows)}
        if negatives is not None:
            negatives = negatives[sl]
            k = self.sampler.k
            texts = [self.fmt.query(ins, q) for (_, q, _), negs in zip(rows, negatives) for ins in negs]
            n_ids, n_mask = self.tokenizer(texts, self.query_max_len)
            batch["n_ids"] = n_ids.reshape(len(rows), k, -1)
            batch["n_mask"] = n_mask.reshape(len(rows), k, -1)
        return batch

    def _passages(self, rows) -> dict[str, np.ndarray]:
        p_ids, p_mask = self.tokenizer([self.fmt.passage(p) for _, _, p in rows], self.passage_max_len)
        return {"p_ids": p_ids, "p_mask": p_mask}

    def _cross_attention_batch(self, rows) -> dict[str, np.ndarray]:
        """Instructions and queries tokenized apart, plus an id per distinct instruction text of
        the global batch (rows sharing an instruction are not each other's I-negatives)."""
        text_ids = {t: i for i, t in enumerate(dict.fromkeys(r[0] for r in rows))}
        groups = np.array([text_ids[r[0]] for r in rows], np.int32)
        sl = self.local_slice()
        rows = rows[sl]
        i_ids, i_mask = self.tokenizer([self.fmt.alone(i) for i, _, _ in rows], self.query_max_len)
        qo_ids, qo_mask = self.tokenizer([self.fmt.alone(q) for _, q, _ in rows], self.query_max_len)
        return {"i_ids": i_ids, "i_mask": i_mask, "qo_ids": qo_ids, "qo_mask": qo_mask, "i_group": groups[sl],
                **self._passages(rows)}
