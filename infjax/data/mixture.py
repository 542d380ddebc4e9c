"""Source mixtures: which sources (splits of data.source) the records of each step come from.

With `data.mixture` ("msmarco:0.6,metamath:0.4") or `data.mixture_alpha` (weights proportional to n^alpha), a
step's global batch is drawn by weight, either from one source (`data.batch_from = one_source`, the default with
a mixture: the in-batch negatives are all of one domain) or from several in the same batch (`mixed`: how many
records each source gives is drawn per step). Which source, or how many of each, is a pure function of
(seed, step), drawn in blocks of BLOCK steps, so every process and every resume sees the same batches without
talking. Each source is read as a stream of its own records, reshuffled each time it is used up (its own epoch);
a step takes the next records of its source's stream, where the counts of the steps before it left off.

An epoch of a mixture run is as many records as the sources hold together (`steps_per_epoch`, the same count as
without a mixture): train.epochs counts those. docs/recipes.md §1 says when to use which.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from infjax.errors import ConfigError

BLOCK = 4096             # steps whose sources are drawn by one generator (a resume redraws only its own block)
BATCH_FROM = ("auto", "one_source", "mixed")


def parse(text: str) -> list[tuple[str, float]]:
    """data.mixture ("name:weight,...") as [(name, weight)]; ValueError naming what is wrong."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, weight = item.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not sep or not name.strip() or not (w > 0 and math.isfinite(w)):
            raise ValueError(f"{item!r} is not <split>:<weight> with a weight > 0 (e.g. msmarco:0.6)")
        out.append((name.strip(), w))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"a split is named twice in {text!r}")
    return out


def weights(names: list[str], sizes: list[int], mixture: str, alpha: float) -> np.ndarray | None:
    """Each source's probability (in `names`' order), or None when no mixture is asked for."""
    if mixture.strip():
        given = dict(parse(mixture))
        w = np.array([given[n] for n in names], np.float64)
    elif alpha > 0:
        w = np.asarray(sizes, np.float64) ** alpha
    else:
        return None
    return w / w.sum()


@dataclasses.dataclass(frozen=True, eq=False)      # compared and hashed as one object: it keys its caches
class MixturePlan:
    """Which records form the global batch of each step, drawn from sources by weight (the `BatchPlan` interface)."""

    names: tuple[str, ...]           # the sources (data.splits' order)
    members: tuple[np.ndarray, ...]  # each source's training records (indices into the store)
    probabilities: np.ndarray        # [S], summing to 1
    batch_size: int                  # records per global batch
    seed: int
    one_source: bool = True          # every batch from one source; else counts per source drawn per step

    def __post_init__(self):
        if self.batch_size < 1:
            raise ConfigError(f"config.train.batch_size={self.batch_size}: must be >= 1")
        small = [(n, len(m)) for n, m, p in zip(self.names, self.members, self.probabilities)
                 if p > 0 and len(m) < (self.batch_size if self.one_source else 1)]
        if small:
            name, n = small[0]
            raise ConfigError(f"config.data.mixture: source {name!r} has {n} records, fewer than one batch of "
                              f"config.train.batch_size={self.batch_size}, which data.batch_from=one_source takes "
                              f"from it alone (lower the batch size, or drop or merge the source)")

    @classmethod
    def of_splits(cls, split: np.ndarray, names: list[str], probabilities: np.ndarray, batch_size: int, seed: int,
                  one_source: bool) -> "MixturePlan":
        """The plan over training records whose splits (indices into `names`) are `split`."""
        members = tuple(np.flatnonzero(split == s) for s in range(len(names)))
        return cls(tuple(names), members, np.asarray(probabilities, np.float64), batch_size, seed, one_source)

    @property
    def num_records(self) -> int:
        return sum(len(m) for m in self.members)

    @property
    def steps_per_epoch(self) -> int:
        return max(self.num_records // self.batch_size, 1)

    def position(self, step: int) -> dict[str, int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        return {"step": step, "epoch": epoch, "offset": offset}

    # --- the draw
    def counts(self, step: int) -> np.ndarray:
        """[S] records each source gives to step `step` (one_source: the batch size at one source)."""
        return _block_counts(self, step // BLOCK)[step % BLOCK]

    def source_of(self, step: int) -> str | None:
        """The source of step `step` (None for mixed batches)."""
        return self.names[int(np.argmax(self.counts(step)))] if self.one_source else None

    def _before(self, step: int) -> np.ndarray:
        """[S] records each source gave to steps 0 .. step-1: where its stream is at `step`."""
        block, within = divmod(step, BLOCK)
        return _block_start(self, block) + _block_counts(self, block)[:within].sum(axis=0)

    def record_indices(self, step: int) -> np.ndarray:
        start, counts = self._before(step), self.counts(step)
        return np.concatenate([self._stream(s, int(start[s]), int(counts[s])) for s in range(len(self.names))
                               if counts[s]])

    def _stream(self, s: int, start: int, count: int) -> np.ndarray:
        """Records start .. start+count-1 of source s's stream (its records, reshuffled at each pass)."""
        members = self.members[s]
        k = np.arange(start, start + count)
        passes, offsets = np.divmod(k, len(members))
        out = np.empty(count, np.int64)
        for p in np.unique(passes):
            order = _source_order(self.seed, s, int(p), len(members))
            out[passes == p] = members[order[offsets[passes == p]]]
        return out

    # --- what the run says of it
    def describe(self) -> str:
        how = "one source per batch" if self.one_source else "sources mixed within each batch"
        parts = ", ".join(f"{n} {len(m)} records, weight {p:.3f}" for n, m, p in
                          zip(self.names, self.members, self.probabilities))
        return f"mixture ({how}): {parts}"

    def summary(self, start: int, stop: int) -> str:
        """Records each source gave to steps start .. stop-1, against its weight."""
        got = self._before(stop) - self._before(start)
        total = max(int(got.sum()), 1)
        unit = self.batch_size if self.one_source else 1
        what = "steps" if self.one_source else "records"
        return "mixture: " + ", ".join(f"{n} {int(g) // unit} {what} ({100 * g / total:.1f}%, weight "
                                       f"{100 * p:.1f}%)" for n, g, p in zip(self.names, got, self.probabilities))


@functools.lru_cache(maxsize=8)
def _block_counts(plan: MixturePlan, block: int) -> np.ndarray:
    """[BLOCK, S] records per source of each step of `block`, drawn by one generator seeded by (seed, block)."""
    rng = np.random.default_rng([plan.seed, 11, block])
    if plan.one_source:
        chosen = rng.choice(len(plan.names), size=BLOCK, p=plan.probabilities)
        out = np.zeros((BLOCK, len(plan.names)), np.int64)
        out[np.arange(BLOCK), chosen] = plan.batch_size
        return out
    return rng.multinomial(plan.batch_size, plan.probabilities, size=BLOCK).astype(np.int64)


def _block_start(plan: MixturePlan, block: int) -> np.ndarray:
    """[S] records each source gave before `block` (the blocks' sums, accumulated once per plan)."""
    sums = _block_sums(plan)
    while len(sums) <= block:
        sums.append(sums[-1] + _block_counts(plan, len(sums) - 1).sum(axis=0))
    return sums[block]


@functools.lru_cache(maxsize=8)
def _block_sums(plan: MixturePlan) -> list[np.ndarray]:
    return [np.zeros(len(plan.names), np.int64)]


@functools.lru_cache(maxsize=4)
def _source_order(seed: int, source: int, rank: int, n: int) -> np.ndarray:
    """The order of a source's records in its `rank`-th pass."""
    return np.random.default_rng([seed, 13, source, rank]).permutation(n)


class SourceSampler:
    """Instruction negatives from the step's source's own instructions (one source per batch): the K of a row are
    drawn as `InstructionNegativeSampler` draws them, over the pool indices of that source's records."""

    def __init__(self, plan: MixturePlan, own: np.ndarray, k: int, sampler_class):
        self.plan, self.k = plan, k
        self.pools = [np.unique(np.asarray(own)[m].reshape(-1)) for m in plan.members]
        self.samplers = []
        for name, pool in zip(plan.names, self.pools):
            try:
                self.samplers.append(sampler_class(len(pool), k, plan.seed))
            except ConfigError as e:
                raise ConfigError(f"{e} in source {name!r} (data.batch_from=one_source draws them from it)") from None

    def draw(self, step: int, own: np.ndarray) -> np.ndarray:
        s = self.plan.names.index(self.plan.source_of(step))
        pool = self.pools[s]
        local = np.searchsorted(pool, np.asarray(own))
        return pool[self.samplers[s].draw(step, local)]
