"""What a run is made of, built from its config: records, objective, batches, optimizer, compiled step.

`infjax.train`, the benchmarks and the tests build a run through these
functions, so that a benchmark measures, and a test checks, exactly the step
that trains.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence

import jax
import numpy as np

from infjax import losses
from infjax.data import batches, packing, synthetic, token_store
from infjax.data.inf_ir import DEFAULT_FIELD_MAP, FIELDS, LEGACY_FIELD_MAP, SourceRecords, local_files, open_split
from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.errors import ConfigError
from infjax.models.hf import files as hf_files
from infjax.models import remat as remat_lib
from infjax.models.encoder import Encoder
from infjax.runtime import distributed
from infjax.runtime import mesh as mesh_lib
from infjax.training import remat_choice, step as step_lib

log = logging.getLogger("infjax")

FIELD_MAPS = {"auto": None, "default": DEFAULT_FIELD_MAP, "legacy": LEGACY_FIELD_MAP}


def text_encoding(config) -> token_store.Encoding:
    """How the run's texts become ids: its lengths, text format and interaction."""
    fmt = TextFormat(config.data.query_template, config.data.query_prefix, config.data.passage_prefix)
    return token_store.Encoding(config.data.query_max_len, config.data.passage_max_len, fmt,
                                config.model.interaction)


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """The training records: their ids (data/token_store.py) and, read when asked for, their texts."""

    store: token_store.TokenStore
    records: Sequence[dict]

    @property
    def fingerprint(self) -> dict:
        """{"records": count, "hash": 16 hex digits over every field of every record, in order, "of": ...}: a
        changed, added, removed or reordered record changes it."""
        return self.store.fingerprint


@dataclasses.dataclass(frozen=True)
class SplitOpener:
    """Opens the splits of config.data as memory-mapped datasets (picklable: a worker that needs the texts
    opens them again from the Arrow files)."""

    source: str
    splits: tuple[str, ...]
    field_map: str
    limit: int
    arrow_dirs: tuple[str | None, ...]      # per split: where its local files become Arrow files (None: hub)

    def __call__(self) -> list:
        out = []
        for split, arrow_dir in zip(self.splits, self.arrow_dirs):
            dataset, resolved = open_split(self.source, split, field_map=FIELD_MAPS[self.field_map],
                                           limit=self.limit or None, arrow_dir=arrow_dir)
            out.append((split, dataset, resolved))
        return out


def open_training_data(config, model_path: str, padding_side: str = "right", records: list[dict] | None = None,
                       workers: int | None = None) -> TrainingData:
    """The training data of `config.data` as a token store: read from the token cache, or tokenized now (once)
    and cached. `records` (in memory: the synthetic corpus, benchmarks, tests) are tokenized in memory, not
    cached. Its warnings (bad rows skipped, duplicates) are logged on every run, from the cache too."""
    data = config.data
    encoding = text_encoding(config)
    reading = token_store.Reading(data.on_bad_row, data.get("dedupe", True))
    if records is None and data.source == "synthetic":
        s = data.synthetic
        records = synthetic.make_synthetic(s.seed, s.num_train, s.num_eval_queries, s.pool_size)[0]
    if records is not None:
        store = token_store.in_memory(records, model_path, encoding, reading, padding_side)
        texts: Sequence[dict] = SourceRecords(InMemorySplit(records), np.asarray(store.source)[np.asarray(store.kept)])
    else:
        store, texts = _cached(data, model_path, padding_side, encoding, reading,
                               data.get("tokenize_workers", -1) if workers is None else workers)
    for line in store.meta["warnings"]:
        log.warning("%s", line)
    if not store.exact:
        log.warning("data: the query texts cannot be assembled from their fields' ids (%d of the data's differ from "
                    "the tokenizer's own ids, e.g. %s): each step's texts are tokenized as the step is built, which "
                    "is slower", store.meta["mismatch"], store.meta["mismatch_example"])
    return TrainingData(store, texts)


@dataclasses.dataclass(frozen=True)
class InMemorySplit:
    """In-memory records as the one split `SourceRecords` reads."""

    records: list[dict]

    def __call__(self) -> list:
        return [("records", self.records, dict(DEFAULT_FIELD_MAP))]


def _cached(data, model_path: str, padding_side: str, encoding, reading, workers: int):
    splits = tuple(s.strip() for s in data.splits.split(",") if s.strip())
    root = token_store.cache_root(data.get("cache_dir", ""))
    tokenizer = Tokenizer(model_path, padding_side)
    identity, arrow_dirs = [], []
    t0 = time.perf_counter()
    log.info("identifying the training data %s (splits %s) by its content", data.source, ", ".join(splits))
    for split in splits:
        try:
            files = local_files(data.source, split)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"config.data.source={data.source!r}: {e}") from e
        if files is None:                     # a hub split: datasets' own cache is memory-mapped, its fingerprint
            dataset, _ = open_split(data.source, split)
            identity.append({"split": split, "hub": data.source, "fingerprint": dataset._fingerprint})  # noqa: SLF001
            arrow_dirs.append(None)
        else:
            digests = [token_store.file_digest(f) for f in files]
            identity.append({"split": split, "files": digests})
            arrow_dirs.append(os.path.join(root, "arrow", token_store.key_digest({"files": digests})))
    log.info("training data identified by content in %.1f s (%s)", time.perf_counter() - t0, ", ".join(
        f"{i['split']}: {len(i['files'])} file(s)" if "files" in i else f"{i['split']}: hub" for i in identity))
    opener = SplitOpener(data.source, splits, data.field_map, data.limit, tuple(arrow_dirs))
    key = {"version": token_store.VERSION, "data": identity, "field_map": data.field_map, "limit": data.limit,
           "reading": dataclasses.asdict(reading), "tokenizer": tokenizer.identity(), "encoding": encoding.key()}
    store = token_store.open_cached(lambda: token_store.Job(opener(), model_path, padding_side, encoding), reading,
                                    key, root, workers)
    return store, SourceRecords(opener, np.asarray(store.source)[np.asarray(store.kept)])


def make_objective(config) -> losses.Objective:
    """The paper's objective named by `config.objective` (or the reference code's reading of the name)."""
    if config.loss.convention == "reference":
        return losses.reference_objective(config.objective, config.loss.temperature)
    return losses.Objective.from_name(config.objective, config.loss.temperature, config.loss.positive_once)


@dataclasses.dataclass(frozen=True)
class BatchSetup:
    """How text becomes the batches of a run."""

    tokenizer: Tokenizer
    fmt: TextFormat                   # query template and prefixes
    plan: batches.BatchPlan           # records of each step (a pure function of seed and step)
    build: batches.BatchBuilder       # step -> this process's slice of the global batch (see data/batches.py)


def make_batch_setup(config, data: TrainingData, encoder: Encoder, model_path: str,
                     objective: losses.Objective, num_devices: int | None = None) -> BatchSetup:
    """Tokenizer, text format, batch plan and builder; with data.packing, the packed capacities too."""
    max_positions = hf_files.load_hf_config(model_path).get("max_position_embeddings")
    for key in ("query_max_len", "passage_max_len"):
        if max_positions and config.data[key] > max_positions:
            raise ConfigError(f"config.data.{key}={config.data[key]} exceeds the model's max_position_embeddings="
                             f"{max_positions} ({model_path}/config.json)")
    tokenizer = Tokenizer(model_path, padding_side=encoder.padding_side)
    fmt = TextFormat(config.data.query_template, config.data.query_prefix, config.data.passage_prefix)
    plan = batches.BatchPlan(len(data.store), config.train.batch_size, config.train.seed)
    cross = config.model.interaction == "cross_attention"
    sampler = (batches.InstructionNegativeSampler(len(data.store.pool), config.loss.instruction_negatives,
                                                  config.train.seed)
               if objective.needs_instruction_negatives and not cross else None)
    build = batches.BatchBuilder(data.store, plan, config.data.query_max_len, config.data.passage_max_len,
                                 config.data.hard_negatives, sampler, jax.process_index(), jax.process_count(),
                                 config.model.interaction, padding_side=encoder.padding_side,
                                 texts=batches.Texts(data.records, tokenizer, fmt))
    if config.data.packing:
        build = dataclasses.replace(build, pack_lengths={"query": config.data.pack_length_query,
                                                         "passage": config.data.pack_length_passage})
        build = dataclasses.replace(build, **packed_layout(config, build, plan, num_devices or jax.device_count(),
                                                                  encoder))
    return BatchSetup(tokenizer, fmt, plan, build)


OVERRIDES = {"q": "pack_rows_query", "i": "pack_rows_query", "qo": "pack_rows_query", "p": "pack_rows_passage",
             "n": "pack_rows_negatives"}


def packed_layout(config, build: batches.BatchBuilder, plan: batches.BatchPlan, num_devices: int,
                  encoder: Encoder) -> dict:
    """The builder's packing fields: the packed shapes (row lengths, and up to data.pack_shapes sets of row
    counts measured over the run; config overrides fix a side's rows) and, under gradient caching, the
    chunks of each side (its texts / train.chunk_size), each packed apart. Row lengths are costed by the
    `encoder`'s attention (`attention_span`)."""
    data, fsdp, _ = mesh_lib.mesh_shape(config.mesh, num_devices)
    shards = data * fsdp
    sides = {side: v.lengths for side, v in build.side_ids(0, local=False, ids=False)[0].items()}
    chunk = config.train.chunk_size
    build = dataclasses.replace(build, chunks={side: len(texts) // chunk for side, texts in sides.items()}
                                if chunk else None)
    t0 = time.perf_counter()
    steps = total_steps(config, plan)
    fixed = {side: config.data[OVERRIDES[side]] for side in sides if config.data[OVERRIDES[side]]}
    span = attention_span(encoder, config.model.dropout)
    multiple = row_multiple(encoder, config.model.dropout)
    shapes = batches.measure_shapes(build, range(steps), shards, config.data.pack_shapes, fixed, PACK_SHAPE_GAIN,
                                    span, multiple)
    for side in sorted(sides):
        chunks = (build.chunks or {}).get(side, 1)
        texts = len(sides[side]) // shards // chunks
        rows = "/".join(str(r[side]) for r in shapes.rows)
        source = f"data.{OVERRIDES[side]}" if side in fixed else "measured"
        most = (shapes.texts or {}).get(side)
        log.info("packing %-2s: %s rows x %d tokens per batch shard%s for %d texts of <= %d tokens, %s a row "
                 "(rows: %s)", side, rows, shapes.lengths[side], f" and chunk (x{chunks} chunks)" if build.chunks else "",
                 texts, build.max_len(side), f"at most {most} texts" if most else "any number of texts", source)
    counts = np.bincount(shapes.of_step, minlength=len(shapes.rows))
    log.info("packing: %d shape(s) (one compiled step each), steps per shape %s; measured over %d of %d steps in "
             "%.1fs; row cost: %s", len(shapes.rows), "/".join(str(int(c)) for c in counts), len(shapes.of_step),
             steps, time.perf_counter() - t0, "tokens (attention per text)" if math.isinf(span) else
             f"tokens x (1 + length / {span:g}) (attention over the whole row)")
    return {"capacities": shapes.capacities(shapes.largest), "shapes": shapes,
            "shards": shards // jax.process_count(), "chunks": build.chunks,
            "capacity_keys": {side: f"data.{OVERRIDES[side]}" for side in sides}, "fixed_sides": tuple(fixed)}


def attention_span(encoder: Encoder, dropout: bool) -> float:
    """`packing.row_cost`'s span for this encoder: infinite where its attention costs per text (the CPU
    kernel), else packing.ATTENTION_SPAN. Every process must agree, since the shapes must: one whose
    attention would cover whole rows (e.g. no compiler for the kernel) makes all of them cost whole rows."""
    whole_row = distributed.max_over_processes(int(not encoder.attention_costs_per_text(dropout)))
    return packing.ATTENTION_SPAN if whole_row else math.inf


def row_multiple(encoder: Encoder, dropout: bool) -> int:
    """What packed row lengths are a multiple of: packing.LENGTH_STEP, or what the encoder's attention kernel
    needs (TPU splash: 128), the largest over the processes."""
    return distributed.max_over_processes(encoder.attention_row_multiple(dropout) or packing.LENGTH_STEP)


# A further packed shape is compiled only if it lowers the run's packed encoder cost by more than this share.
PACK_SHAPE_GAIN = 0.02


def total_steps(config, plan: batches.BatchPlan) -> int:
    """`train.steps`, or `train.epochs` over the data when it is 0."""
    return config.train.steps or config.train.epochs * plan.steps_per_epoch


def compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding, example=None,
                        memory_device=None):
    """The jitted train step (explicit shardings, donated state), with gradient caching per config.

    The encoder's activations keep their rows split over the batch axes layer by layer (see
    `layers.run_layers`), so fsdp gathers kernels rather than every device encoding every row.

    With `model.remat=auto`, `example` (the state and the widest batch, arrays or ShapeDtypeStructs with their
    shardings) is compiled under each policy until one fits the memory of `memory_device` (default: the mesh's
    first device), training/remat_choice.py; the choice is logged in one line and its compiled program kept."""
    if remat_lib.normalize(config.model.remat) != "auto":       # offload where it cannot: full, one warning
        policy = remat_lib.effective(encoder.remat)
        encoder = encoder if policy == encoder.remat else encoder.with_remat(policy)
        return jitted_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding)
    if example is None:
        raise ValueError("model.remat=auto needs the step's example inputs to choose a policy")

    def compile_policy(policy: str) -> remat_choice.Tried:
        step = jitted_step(config, encoder.with_remat(policy), objective, optimizer, schedule, mesh, state_sharding)
        t0 = time.perf_counter()
        try:
            compiled = step.lower(*example).compile()
        except Exception as err:     # noqa: BLE001 - a compiler refusing the memory (TPU) is an answer
            line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if "exceed" not in line.lower() and "memory" not in line.lower():
                raise
            log.info("remat auto: %s refused by the compiler: %s", policy, line[:200])
            return remat_choice.Tried(policy, None, line, step)
        peak = peak_bytes(compiled)
        log.info("remat auto: %s compiled in %.0f s, peak %.2f GB per device", policy, time.perf_counter() - t0,
                 peak / 1e9)
        return remat_choice.Tried(policy, peak, None, step, compiled)

    device = memory_device if memory_device is not None else mesh.devices.flat[0]
    choice = remat_choice.choose(compile_policy, remat_choice.capacity(config.model.remat_memory_gb, device))
    log.info(choice.line)
    chosen = choice.chosen
    return remat_choice.Precompiled(chosen.step, chosen.compiled, example[1], choice.policy, choice.line)


def peak_bytes(compiled) -> int:
    """A compiled program's peak memory per device: arguments, temporaries and outputs, less what outputs reuse
    of the (donated) arguments."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def widest_step(build) -> int:
    """A step packed in the run's widest shape (the first: it holds every step); step 0 when not packed."""
    shapes = getattr(build, "shapes", None)
    if shapes is None:
        return 0
    return shapes.first_step_of(0)


def abstract_global_batch(local: dict, mesh) -> dict:
    """This process's slice of a batch as the global batch's ShapeDtypeStructs (rows of every process, split
    over the mesh's batch axes), what `mesh_lib.global_batch` would make of it."""
    sharding = mesh_lib.batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * jax.process_count(),) + tuple(x.shape[1:]),
                                                       x.dtype, sharding=sharding), local)


def jitted_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding):
    """The jitted train step of `encoder` as it is (its remat policy included)."""
    encoder = encoder.with_activation_sharding(mesh_lib.batch_sharding(mesh))
    # A dropout key goes to the encoder when the backbone's dropout or LoRA's applies; the backbone's own
    # dropout layers follow model.dropout either way.
    encoder = dataclasses.replace(encoder, backbone_dropout=bool(config.model.dropout))
    dropout = bool(config.model.dropout) or bool(encoder.lora and encoder.lora.dropout > 0)
    return step_lib.jit_train_step(
        step_lib.make_train_step(encoder, objective, optimizer, schedule, dropout,
                                 config.train.chunk_size, mesh), mesh, state_sharding)
