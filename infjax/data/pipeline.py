"""The input pipeline of a run, built from its config in one place: splits -> token store -> step builder.

Read top to bottom, as maxtext's input pipeline reads (docs/data.md):

1. `open_training_data`: the splits of `config.data` (inf_ir.py: memory-mapped Arrow files, or the records
   in memory), tokenized once into the token store (token_store.py: read from the token cache, whose key is
   made beside it, or built now).
2. `make_batch_setup`: the batch plan and the instruction-negative sampler, the texts of each step
   (batches.StepTexts), with data.packing the packed shapes measured over the run (`measure_packing`), and
   the builder of a step's arrays, made in one call. prefetch.py then builds the steps ahead of the loop.

What only the model and the mesh know comes in as plain values (`BatchLayout`): the padding side, the batch
shards, this process's place among the processes, and what the attention kernel makes of packed rows. This
package imports nothing of models, losses, runtime or training (docs/layout.md §1); the config is read as
values: `config.data`, `config.train` (batch_size, seed, steps, epochs, chunk_size),
`config.loss.instruction_negatives` and `config.model.interaction`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from infjax.data import batches, inf_ir, mixture, packing, synthetic, token_store
from infjax.data.tokenize import TextFormat, Tokenizer

log = logging.getLogger("infjax.data")

# The key of config.data that fixes each side's packed rows (0: measured over the run).
ROWS_KEY = {"q": "pack_rows_query", "i": "pack_rows_query", "qo": "pack_rows_query", "p": "pack_rows_passage",
            "n": "pack_rows_negatives"}

# A further packed shape is compiled only if it lowers the run's packed encoder cost by more than this share.
PACK_SHAPE_GAIN = 0.02


def text_format(data) -> TextFormat:
    """The query template and prefixes of `config.data`."""
    return TextFormat(data.query_template, data.query_prefix, data.passage_prefix)


# --------------------------------------------------------------------------
# 1. The training records: read, tokenized once
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainingData:
    """The training records: their ids (data/token_store.py), how they were made, and their texts on demand."""

    store: token_store.TokenStore
    records: Sequence[dict]            # the clean records as text, read when asked for (inf_ir.SourceRecords)
    encoding: token_store.Encoding     # the lengths, text format and interaction the ids were made for

    @property
    def fingerprint(self) -> dict:
        """{"records": count, "hash": 16 hex digits over every field of every record, in order, "of": ...}.

        A changed, added, removed or reordered record changes it."""
        return self.store.fingerprint


_SYNTHETIC_STORES: collections.OrderedDict = collections.OrderedDict()   # the last few, by what makes them


def synthetic_store(s, model_path: str, encoding: token_store.Encoding, reading: token_store.Reading,
                    padding_side: str) -> tuple[list[dict], token_store.TokenStore]:
    """The synthetic corpus of `s` (config.data.synthetic) and its store, made once per process for each
    (corpus, tokenizer pipeline, encoding, reading): a second run, benchmark or evaluation in the process reads
    the same records and ids without tokenizing them again."""
    key = (s.seed, s.num_train, s.num_eval_queries, s.pool_size, Tokenizer(model_path, padding_side).identity(),
           encoding, reading, padding_side)
    if key not in _SYNTHETIC_STORES:
        records = synthetic.make_synthetic(s.seed, s.num_train, s.num_eval_queries, s.pool_size)[0]
        _SYNTHETIC_STORES[key] = (records, token_store.in_memory(records, model_path, encoding, reading,
                                                                 padding_side))
        while len(_SYNTHETIC_STORES) > 4:
            _SYNTHETIC_STORES.popitem(last=False)
    _SYNTHETIC_STORES.move_to_end(key)
    return _SYNTHETIC_STORES[key]


def open_training_data(config, model_path: str, padding_side: str = "right", records: list[dict] | None = None,
                       workers: int | None = None) -> TrainingData:
    """The training data of `config.data` as a token store: read from the token cache, or tokenized now (once).

    `records` (in memory: benchmarks, tests) are tokenized in memory, not cached; the synthetic corpus is made and
    tokenized once per process (`synthetic_store`). The
    store's warnings (bad rows skipped, duplicates) are logged on every run, from the cache too. `workers`:
    the tokenizing processes (default data.tokenize_workers).
    """
    data = config.data
    encoding = token_store.Encoding(data.query_max_len, data.passage_max_len, text_format(data),
                                    config.model.interaction)
    reading = token_store.Reading(data.on_bad_row, data.get("dedupe", True))
    if records is None and data.source == "synthetic":
        records, store = synthetic_store(data.synthetic, model_path, encoding, reading, padding_side)
        splits = inf_ir.InMemorySplit(records)
    elif records is not None:
        splits = inf_ir.InMemorySplit(records)
        store = token_store.in_memory(records, model_path, encoding, reading, padding_side)
    else:
        names = tuple(s.strip() for s in data.splits.split(",") if s.strip())
        root = token_store.cache_root(data.get("cache_dir", ""))
        tokenizer = Tokenizer(model_path, padding_side)
        shared = data.get("cache_shared", False)
        identity, arrow_dirs = token_store.identify(data.source, names, root, shared)
        splits = inf_ir.SplitOpener(data.source, names, data.field_map, data.limit, arrow_dirs)
        key = token_store.cache_key(identity, data.field_map, data.limit, reading, tokenizer, encoding)
        store = token_store.open_cached(lambda: token_store.Job(splits(), model_path, padding_side, encoding),
                                        reading, key, root,
                                        data.get("tokenize_workers", -1) if workers is None else workers, shared)
    for line in store.meta["warnings"]:
        log.warning("%s", line)
    if not store.exact:
        log.warning("data: the query texts cannot be assembled from their fields' ids (%d of the data's differ from "
                    "the tokenizer's own ids, e.g. %s): each step's texts are tokenized as the step is built, which "
                    "is slower", store.meta["mismatch"], store.meta["mismatch_example"])
    texts = inf_ir.SourceRecords(splits, np.asarray(store.source)[np.asarray(store.kept)])
    return TrainingData(store, texts, encoding)


# --------------------------------------------------------------------------
# 2. The batches: plan, texts of a step, packing, builder
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """What the model and the mesh decide about a step's arrays, as plain values.

    The packing fields matter only with data.packing; their defaults are packing's own.
    """

    padding_side: str = "right"                     # where padded batches put the pad ids (decoders: left)
    process_index: int = 0
    process_count: int = 1
    shards: int = 1                                 # batch shards of the global batch (data x fsdp), packed apart
    attention_span: float = packing.ATTENTION_SPAN  # packing.row_cost's span (math.inf: attention costs per text)
    row_multiple: int = packing.LENGTH_STEP         # what packed row lengths are a multiple of


@dataclasses.dataclass(frozen=True)
class BatchSetup:
    """How text becomes the batches of a run."""

    tokenizer: Tokenizer
    fmt: TextFormat                   # query template and prefixes
    plan: batches.BatchPlan           # records of each step (a pure function of seed and step)
    build: batches.BatchBuilder       # step -> this process's slice of the global batch (see data/batches.py)


def make_batch_setup(config, data: TrainingData, model_path: str, layout: BatchLayout,
                     instruction_negatives: bool) -> BatchSetup:
    """The tokenizer, text format, batch plan and step builder of a run; with data.packing, its packed shapes.

    `instruction_negatives`: whether the objective draws them (Interaction I only).
    """
    tokenizer = Tokenizer(model_path, padding_side=layout.padding_side)
    fmt = data.encoding.fmt
    plan = make_plan(config, data.store)
    cross = config.model.interaction == "cross_attention"
    sampler = None
    if instruction_negatives and not cross and isinstance(plan, mixture.MixturePlan) and plan.one_source:
        sampler = mixture.SourceSampler(plan, data.store.own, config.loss.instruction_negatives,
                                        batches.InstructionNegativeSampler)
    elif instruction_negatives and not cross:
        sampler = batches.InstructionNegativeSampler(len(data.store.pool), config.loss.instruction_negatives,
                                                     config.train.seed)
    texts = batches.StepTexts(data.store, plan, config.data.query_max_len, config.data.passage_max_len,
                              config.data.hard_negatives, sampler, layout.process_index, layout.process_count,
                              config.model.interaction, batches.Texts(data.records, tokenizer, fmt),
                              text_keys=config.loss.mask_duplicates)
    packed = measure_packing(config, texts, layout) if config.data.packing else None
    return BatchSetup(tokenizer, fmt, plan, batches.BatchBuilder(texts, packed, layout.padding_side))


def make_plan(config, store: token_store.TokenStore) -> batches.BatchPlan | mixture.MixturePlan:
    """The records of each step: one shuffled order over all records, or a mixture of the splits by weight
    (data.mixture, data.mixture_alpha; data/mixture.py)."""
    data, train = config.data, config.train
    names = [s.strip() for s in data.splits.split(",") if s.strip()]
    if not data.get("mixture", "").strip() and not data.get("mixture_alpha", 0):
        return batches.BatchPlan(len(store), train.batch_size, train.seed)
    bounds = np.cumsum([0] + list(store.meta["split_rows"]))      # source rows: the splits one after another
    split = np.searchsorted(bounds, np.asarray(store.source)[np.asarray(store.kept)], side="right") - 1
    probabilities = mixture.weights(names, np.bincount(split, minlength=len(names)).tolist(), data.mixture,
                                    data.mixture_alpha)
    plan = mixture.MixturePlan.of_splits(split, names, probabilities, train.batch_size, train.seed,
                                         data.batch_from != "mixed")
    log.info("%s", plan.describe())
    return plan


def total_steps(config, plan: batches.BatchPlan) -> int:
    """`train.steps`, or `train.epochs` over the data when it is 0."""
    return config.train.steps or config.train.epochs * plan.steps_per_epoch


def measure_packing(config, texts: batches.StepTexts, layout: BatchLayout) -> batches.Packing:
    """How a run packs its sides: the packed shapes measured over its steps, and the chunks of each side.

    The shapes: row lengths, and up to data.pack_shapes sets of row counts measured over the run
    (`batches.measure_shapes`); config overrides fix a side's rows. Under gradient caching each side is packed
    in chunks of train.chunk_size texts, each apart. Row lengths are costed by the model's attention
    (`layout.attention_span`). Logs a line per side and one for the shapes.
    """
    data = config.data
    sides = texts.side_lengths(0, local=False)
    chunk = config.train.chunk_size
    chunks = {side: len(n) // chunk for side, n in sides.items()} if chunk else None
    t0 = time.perf_counter()
    steps = total_steps(config, texts.plan)
    fixed = {side: data[ROWS_KEY[side]] for side in sides if data[ROWS_KEY[side]]}
    shapes = batches.measure_shapes(texts, range(steps), layout.shards, data.pack_shapes, fixed, PACK_SHAPE_GAIN,
                                    layout.attention_span, layout.row_multiple, chunks=chunks,
                                    pack_lengths={"query": data.pack_length_query, "passage": data.pack_length_passage})
    for side in sorted(sides):
        side_chunks = (chunks or {}).get(side, 1)
        count = len(sides[side]) // layout.shards // side_chunks
        rows = "/".join(str(r[side]) for r in shapes.rows)
        source = f"data.{ROWS_KEY[side]}" if side in fixed else "measured"
        most = (shapes.texts or {}).get(side)
        log.info("packing %-2s: %s rows x %d tokens per batch shard%s for %d texts of <= %d tokens, %s a row "
                 "(rows: %s)", side, rows, shapes.lengths[side],
                 f" and chunk (x{side_chunks} chunks)" if chunks else "", count, texts.max_len(side),
                 f"at most {most} texts" if most else "any number of texts", source)
    counts = np.bincount(shapes.of_step, minlength=len(shapes.rows))
    log.info("packing: %d shape(s) (one compiled step each), steps per shape %s; measured over %d of %d steps in "
             "%.1fs; row cost: %s", len(shapes.rows), "/".join(str(int(c)) for c in counts), len(shapes.of_step),
             steps, time.perf_counter() - t0, "tokens (attention per text)" if math.isinf(layout.attention_span)
             else f"tokens x (1 + length / {layout.attention_span:g}) (attention over the whole row)")
    return batches.Packing(shapes, layout.shards // layout.process_count, chunks,
                           {side: f"data.{ROWS_KEY[side]}" for side in sides}, tuple(fixed))


def widest_step(build: batches.BatchBuilder) -> int:
    """A step packed in the run's widest shape (the first: it holds every step); step 0 when not packed."""
    return build.packing.shapes.first_step_of(0) if build.packing is not None else 0
