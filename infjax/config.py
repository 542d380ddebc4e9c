"""The shared base configuration, presets, and validation.

Config files under configs/ pick an objective and call `base_config`. Every
knob has a default and a comment here; `validate` refuses bad values with
the key named, before anything is loaded or compiled.
"""
from __future__ import annotations

import math
import re

import ml_collections
from ml_collections import config_dict

from infjax.data import inf_ir, mixture as mixture_lib
from infjax.data.tokenize import validate_template
from infjax.errors import ConfigError
from infjax.evaluation.datasets import DataError, parse_spec
from infjax.evaluation.in_training import SYNTHETIC_SET
from infjax import losses
from infjax.losses import OBJECTIVES
from infjax.models import attention, precision, remat as remat_lib
from infjax.models.encoder import EMBEDDED, POOLINGS
from infjax.models.lora import PROJECTIONS as LORA_PROJECTIONS
from infjax.models.registry import FAMILIES
from infjax.training import best as best_lib
from infjax.training.writers import WANDB_MODES, WRITERS as LOG_WRITERS, writer_names

_DECODER = {"model.pooling": "last", "model.remat": "auto", "model.scan_layers": True}

# preset -> overrides. "embedded" is the default: offline, CPU, minutes (on the synthetic corpus; see
# `for_data_source` for other data).
PRESETS = {
    "embedded": {
        "model.checkpoint": EMBEDDED, "model.pooling": "mean",
        "data.source": "synthetic", "data.query_max_len": 48, "data.passage_max_len": 48,
        "loss.instruction_negatives": 3,   # fewer encoder passes on a 2-core CPU (default 5)
        "train.batch_size": 8, "train.steps": 150,
        "train.learning_rate": 5e-5,       # the paper's; 1e-4 gave less p-MRR and a lower docstrings canary
        "log_every": 10, "checkpoint.every": 50,
    },
    # The paper's backbones (docs/method.md §2.1) on InF-IR; they need the hub or a local copy.
    "minilm": {"model.checkpoint": "sentence-transformers/all-MiniLM-L6-v2", "model.pooling": "mean"},
    "e5-base-v2": {"model.checkpoint": "intfloat/e5-base-v2", "model.pooling": "mean",
                   "data.query_prefix": "query: ", "data.passage_prefix": "passage: "},
    "e5-large-v2": {"model.checkpoint": "intfloat/e5-large-v2", "model.pooling": "mean",
                    "data.query_prefix": "query: ", "data.passage_prefix": "passage: "},
    "bge-base-en-v1.5": {"model.checkpoint": "BAAI/bge-base-en-v1.5", "model.pooling": "cls"},
    "bge-large-en-v1.5": {"model.checkpoint": "BAAI/bge-large-en-v1.5", "model.pooling": "cls"},
    "modernbert-base": {"model.checkpoint": "answerdotai/ModernBERT-base", "model.pooling": "mean"},
    # Decoders pad on the left and pool the last token; remat "auto" keeps what fits the device and recomputes
    # the rest, and scanned layers let fsdp gather one layer's kernels at a time (README, Scale).
    "llama-3.2-1b": {"model.checkpoint": "meta-llama/Llama-3.2-1B", **_DECODER},
    "llama-3.2-1b-instruct": {"model.checkpoint": "meta-llama/Llama-3.2-1B-Instruct", **_DECODER},
    "qwen2.5-1.5b": {"model.checkpoint": "Qwen/Qwen2.5-1.5B", **_DECODER},
    "qwen2.5-1.5b-instruct": {"model.checkpoint": "Qwen/Qwen2.5-1.5B-Instruct", **_DECODER},
    "qwen2.5-3b": {"model.checkpoint": "Qwen/Qwen2.5-3B", **_DECODER},
    "qwen2.5-7b": {"model.checkpoint": "Qwen/Qwen2.5-7B", **_DECODER},
}
HUB_DATA = {"data.source": "InF-IR/InF-IR", "data.splits": "msmarco",
            "data.query_max_len": 256, "data.passage_max_len": 512,
            "train.batch_size": 32, "train.steps": 0, "train.learning_rate": 5e-5,
            "model.dtype": "bfloat16"}


def base_config(objective: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """The full default config for `objective`, with preset `arg` (default: "embedded") applied."""
    c = _defaults(objective, arg)
    preset = c.preset
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r} (the config file's argument, after ':'); "
                          f"choose one of {sorted(PRESETS)}")
    overrides = dict(PRESETS[preset]) if preset == "embedded" else {**HUB_DATA, **PRESETS[preset]}
    return override(c, overrides)


def _defaults(objective: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """Every key of the config with its default, before a preset is applied."""
    c = ml_collections.ConfigDict()
    c.objective = objective            # one of losses.OBJECTIVES (the file name under configs/)
    c.preset = arg or "embedded"       # which preset was applied (informational)
    c.resume = False                   # continue from the latest checkpoint in --workdir
    c.log_every = 10                   # steps between log lines / metrics.jsonl records
    c.log = ml_collections.ConfigDict()
    c.log.writers = "jsonl,tensorboard"  # where records go (comma-separated): jsonl = WORKDIR/metrics.jsonl
                                       # (required), tensorboard = event files in WORKDIR/tensorboard/,
                                       # wandb = a Weights & Biases run (pip install -e ".[wandb]")
    c.log.wandb_project = "infjax"     # W&B project
    c.log.wandb_entity = ""            # W&B entity (team or user; "" = the account's default)
    c.log.wandb_name = ""              # W&B run name ("" = the workdir's last component)
    c.log.wandb_mode = ""              # online | offline (run folder in WORKDIR/wandb/, `wandb sync` it later) |
                                       # disabled | "" = the WANDB_MODE environment variable, else online

    c.loss = ml_collections.ConfigDict()
    c.loss.temperature = 0.05          # tau in sim = <x, y> / tau
    c.loss.positive_once = False       # multivariate: count the positive once instead of |T| times
    c.loss.instruction_negatives = 5   # K instructions drawn per row for the I-marginal
    c.loss.convention = "paper"        # paper | reference: read the objective name as the reference
                                       # PyTorch code defines it (its uni = our multi + positive_once,
                                       # its multi = our uni) and divide by temperature + 1e-4 as it
                                       # does, so its loss numbers are reproduced; see
                                       # losses.reference_objective
    c.loss.mask_duplicates = True      # leave out of P, IQ and I every negative that is the row's positive by
                                       # text (another row with the same passage or instruction-aware query,
                                       # a drawn instruction equal to the row's own); docs/method.md §6.2
    c.loss.false_negative_margin = config_dict.placeholder(float)   # None = off; m: also leave out in-batch
                                       # negatives whose cosine exceeds the positive's + m (e.g. -0.05)
    c.loss.matryoshka_dims = ""        # e.g. "384,128,64": the loss on each prefix of the embedding,
                                       # renormalized, summed ("" = the whole embedding only); docs/method.md §6.3
    c.loss.matryoshka_weights = ""     # one weight per dim ("" = each 1)

    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = EMBEDDED      # local folder, hub id, or "embedded:all-MiniLM-L6-v2"
    c.model.family = "auto"            # auto (from config.json's model_type) | bert | modernbert | llama | qwen2
    c.model.pooling = "auto"           # auto (the family's own: mean for encoders, last for decoders) | mean | cls | last
    c.model.shared_encoder = True      # one theta for passages and instruction-queries
    c.model.dtype = "float32"          # compute dtype: float32 | bfloat16 (params stay float32)
    c.model.residual_dtype = "float32" # under bfloat16: the residual stream, norms and lookups in float32, as
                                       # torch.autocast (float32) | in bfloat16 too (compute: half the stream's
                                       # memory, less precise gradients; models/precision.py, docs/precision.md)
    c.model.dropout = False            # apply the checkpoint's dropout during training
    c.model.interaction = "concat"     # concat: iq = g(template(I, Q)) (Interaction I) | cross_attention:
                                       # iq = attention of g(I) over Q's tokens (Interaction II, Eq. 4)
    c.model.remat = "none"             # what each layer keeps for the backward pass (models/remat.py): none
                                       # (keep all) | dots (keep projections, recompute elementwise work) |
                                       # dots_except_mlp | offload (dots kept in host memory; GPU/TPU) | full
                                       # (recompute each layer) | auto (the least recompute whose compiled step
                                       # fits the device, docs/scale.md); True/False = full/none
    c.model.remat_memory_gb = 0.0      # auto plans for this much memory per device (GB); 0 = what the device's
                                       # allocator may hold (its bytes_limit; on CPU, RAM / local devices)
    c.model.scan_layers = False        # run layers with nn.scan (one compiled layer); use it with fsdp for big
                                       # models: unrolled, XLA gathers every layer's kernels at once. Encoders
                                       # stay unrolled: scanned, BERT-base's H100 step launches 2.1x the kernels
                                       # and needs 2x the memory (docs/benchmarks.md, bf16 gradients)
    c.model.lora = ml_collections.ConfigDict()   # low-rank adapters (docs/lora.md): train A, B; the base is frozen
    c.model.lora.rank = 0              # r of every adapter; 0 = off (the whole backbone trains)
    c.model.lora.alpha = 32.0          # the update is (alpha / rank) * x A B
    c.model.lora.dropout = 0.0         # dropout on the adapters' input while training (the base path has none)
    c.model.lora.targets = "all"       # "all" (every Linear layer of the backbone), or comma-separated from
                                       # q,k,v,o (attention) and gate,up,down (MLP; BERT has up,down only;
                                       # ModernBERT fuses q,k,v and gate,up: name all of a fused group or none)
    c.model.lora.base_dtype = "auto"   # storage of the frozen base weights: auto (= model.dtype) | float32 |
                                       # bfloat16 (half the memory; the compute dtype casts them anyway)

    c.data = ml_collections.ConfigDict()
    c.data.source = "synthetic"        # "synthetic", a hub id, or local parquet/jsonl/json path(s)
    c.data.splits = "msmarco"          # comma-separated InF-IR splits (ignored for synthetic)
    c.data.mixture = ""                # "split:weight,..." over data.splits (e.g. "msmarco:0.6,metamath:0.4"):
                                       # each step's records drawn from the splits by weight ("" = one order
                                       # over all records); docs/recipes.md §1
    c.data.mixture_alpha = 0.0         # > 0: weights proportional to each split's records ** alpha (0 = off)
    c.data.batch_from = "auto"         # one_source: every batch from one split | mixed: several per batch |
                                       # auto: one_source with a mixture
    c.data.field_map = "auto"          # auto | default | legacy (P+ named `document`)
    c.data.on_bad_row = "error"        # error | skip (skipped rows are counted and reported)
    c.data.limit = 0                   # use only the first N rows per split (0 = all)
    c.data.dedupe = True               # drop records identical to an earlier one in every field (a warning
                                       # counts them); False keeps them, and a batch may then hold a record
                                       # twice, an in-batch false negative under every objective
    c.data.hard_negatives = True       # 3 rows per record (I-,Q+,P1-) and (I+,Q-,P2-); else 1
    c.data.query_template = "{query} {instruction}"   # instruction-aware query text
    c.data.query_prefix = ""           # e.g. "query: " for e5
    c.data.passage_prefix = ""         # e.g. "passage: " for e5
    c.data.query_max_len = 256         # tokens, query side (static shape)
    c.data.passage_max_len = 512       # tokens, passage side (static shape)
    c.data.packing = True              # pack each batch shard's texts into rows of max_len tokens (segment ids,
                                       # nothing cut or dropped) instead of padding every text to max_len;
                                       # with gradient caching (train.chunk_size > 0) each chunk is packed apart
    c.data.pack_rows_query = 0         # packed rows per batch shard (per chunk of one under gradient caching)
                                       # for q (and Interaction II i, qo); 0 = the most any step needs,
                                       # measured on the host before the first step (over at most 512
                                       # steps; a step past them that needs more grows the shapes)
    c.data.pack_rows_passage = 0       # ... for passages
    c.data.pack_rows_negatives = 0     # ... for the instruction negatives (K per row)
    c.data.pack_length_query = 0       # tokens per packed row, query side (0 = chosen on the host: the multiple
                                       # of 32 from the longest query text of the run up to twice that with the
                                       # least padding plus attention cost, see data/packing.py; with
                                       # pack_rows_query set: data.query_max_len); longer rows hold more texts
                                       # (less padding) but each token's attention spans the row
    c.data.pack_length_passage = 0     # ... passage side
    c.data.pack_shapes = 3             # packed shapes per run, each one compiled step: every step is packed
                                       # into the fewest rows (of those shapes) that hold it, so padding follows
                                       # each step's own texts rather than the run's longest step; a further
                                       # shape is added only if it saves > 2% of the packed encoder cost; 1 = one
                                       # shape that holds every step
    c.data.resume_if_changed = False   # resume even if the training data differs from the checkpoint's (its
                                       # fingerprint: record count and content hash); later batches then differ
    c.data.cache_dir = ""              # where the token cache lives (data/token_store.py): the records' ids,
                                       # tokenized once per data, tokenizer, lengths and text format, reused by
                                       # later runs, resumes and every process of the host; a local (or shared)
                                       # folder, memory-mapped; "" = $INFJAX_CACHE_DIR, else ~/.cache/infjax
    c.data.cache_shared = False        # True: data.cache_dir is shared on purpose (a team's cache): entries and
                                       # Arrow folders other users wrote are used (their digests still checked).
                                       # False: such an entry is refused in one line (it may hold planted ids)
    c.data.tokenize_workers = -1       # processes that tokenize the data once (-1 = one per core, or this
                                       # process alone for fewer than 20,000 rows; 0 = this process)
    c.data.step_workers = -1           # processes that assemble steps ahead of the loop (data/prefetch.py):
                                       # 0 = one background thread of the training process; -1 = as many processes
                                       # as build a step every 10 ms (measured at start; at most the cores less
                                       # one), or the thread where that is fewer than two
    c.data.prefetch = 4                # steps built ahead of the loop at most (their arrays held in memory)
    c.data.synthetic = ml_collections.ConfigDict()
    c.data.synthetic.seed = 0          # generator seed of the synthetic corpus
    c.data.synthetic.num_train = 2000  # training records
    c.data.synthetic.num_eval_queries = 45   # FollowIR-style evaluation queries
    c.data.synthetic.pool_size = 24    # candidates per evaluation query

    c.train = ml_collections.ConfigDict()
    c.train.batch_size = 32            # records per GLOBAL batch (rows = 3x with hard negatives)
    c.train.steps = 0                  # total optimizer steps; 0 = train.epochs over the data
    c.train.epochs = 2                 # used when train.steps == 0
    c.train.learning_rate = 5e-5       # AdamW peak learning rate
    c.train.warmup_steps = 0           # linear warmup steps, then linear decay to 0
    c.train.weight_decay = 0.0         # AdamW weight decay
    c.train.grad_clip = 1.0            # global-norm clipping (0 = off)
    c.train.seed = 42                  # root seed: data order, instruction negatives, dropout
    c.train.nonfinite = "skip"         # a non-finite loss or gradient: skip the update (counted) | stop
    c.train.max_skipped = 0.5          # a run whose skipped (non-finite) steps exceed this share of its steps
                                       # ends with exit status 3 though it finished: it did not train (1.0 = never)
    c.train.stop_grace_s = 300.0       # after SIGTERM/SIGINT/SIGHUP: seconds to finish the step and save; past them the
                                       # run exits (128 + signal) without that save, naming where it was held (0 = wait)
    c.train.chunk_size = 0             # gradient caching: rows per encoder pass (0 = off, one pass per input);
                                       # must divide the rows per global batch and be a multiple of
                                       # mesh.data * mesh.fsdp (the batch shards)
    c.train.moments_dtype = "float32"  # AdamW first moment: float32 | bfloat16 (the second stays float32)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1                   # data-parallel axis size (-1 = the remaining devices)
    c.mesh.fsdp = 1                    # parameters and optimizer state sharded over this axis (ZeRO-3 style);
                                       # the batch is split over data x fsdp
    c.mesh.tensor = 1                  # tensor-parallel axis (attention/MLP projections split); at most one
                                       # of data, fsdp, tensor may be -1

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 500           # steps between checkpoints (one is always written at the end)
    c.checkpoint.max_to_keep = 3       # checkpoints kept in WORKDIR/checkpoints
    c.checkpoint.async_save = True     # write checkpoints in the background while training goes on
    c.checkpoint.fallback = False      # resume: if the latest checkpoint is unreadable, use the newest readable
    c.checkpoint.keep_best = ""        # "<eval set>/<metric>" (e.g. "synthetic/p_mrr", "lee/main"): keep the
                                       # checkpoint where that metric, evaluated every eval.every steps, was
                                       # highest, beside the newest ones ("" = none); export --step=best

    c.eval = ml_collections.ConfigDict()
    c.eval.synthetic = True            # p-MRR / nDCG@5 on the synthetic split before and after training
    c.eval.batch_size = 64             # texts per encoder call during evaluation
    c.eval.sets = ""                   # comma-separated datasets to evaluate during training, as for
                                       # infjax.evaluate --dataset (e.g. "beir:/data/scifact,synthetic")
    c.eval.every = 0                   # steps between evaluations of eval.sets (0 = only at the end)
    c.eval.dims = ""                   # e.g. "128,64": eval.sets' and the canaries' metrics also for embeddings
                                       # cut to these Matryoshka dims ("p_mrr@64"; keep_best may name them)
    c.eval.canary = "lee,docstrings"   # general-retrieval canaries (comma-separated specs, "" = none): evaluated
                                       # before training, with eval.sets, and after; in eval.json and printed
    c.eval.canary_margin = 0.01        # warn when a canary's main metric falls by more than this since before
                                       # training or since its previous evaluation (logged + metrics.jsonl)
    return c


# What the embedded preset sets for its synthetic corpus alone, a run of minutes on a CPU (48 tokens, 8 records
# per batch, 150 steps): every key of it but the model's and the data source.
SYNTHETIC_DEMO = tuple(k for k in PRESETS["embedded"] if not k.startswith("model.") and k != "data.source")


def for_data_source(c: ml_collections.ConfigDict, given=()) -> list[str]:
    """Under the embedded preset, reset the synthetic demo's keys to the defaults for data other than its corpus.

    Under the embedded preset, other data than the synthetic corpus (data.source) trains with the defaults (texts of
    256/512 tokens, 32 records per batch, 2 epochs: what the README's table promises), not with the synthetic demo's
    (`SYNTHETIC_DEMO`); the keys in `given` (set on the command line) keep their values. Changes `c` in place; returns
    the keys it set back to their defaults."""
    if c.get("preset") != "embedded" or c.data.source == "synthetic":
        return []
    defaults, given = _defaults(c.objective), set(given)
    reset = [k for k in SYNTHETIC_DEMO if k not in given and _get(c, k) != _get(defaults, k)]
    override(c, {k: _get(defaults, k) for k in reset})
    return reset


def describe_shape(c: ml_collections.ConfigDict) -> str | None:
    """One line for a run on other data than the synthetic corpus: its preset and model, and the lengths, batch
    and steps it trains with (and the keys that change them); None on the synthetic corpus."""
    if c.data.source == "synthetic":
        return None
    length = f"{c.train.steps} steps" if c.train.steps else f"{c.train.epochs} epoch{'s' * (c.train.epochs != 1)}"
    return (f"data.source={c.data.source}: preset {c.get('preset', '')!r} ({c.model.checkpoint}); queries cut at "
            f"{c.data.query_max_len} tokens, passages at {c.data.passage_max_len}, {c.train.batch_size} records per "
            f"batch, {length} (data.query_max_len, data.passage_max_len, train.batch_size, "
            f"{'train.steps' if c.train.steps else 'train.epochs'} change them)")


PRESET_TIED = ("data.query_prefix", "data.passage_prefix", "model.pooling")   # what a preset sets for its model


def preset_mismatch(c: ml_collections.ConfigDict) -> str | None:
    """A one-line warning when model.checkpoint was overridden away from the preset's model while the preset's
    prefixes or pooling (chosen for that model) still apply; None otherwise."""
    preset = PRESETS.get(c.get("preset", ""), {})
    if not preset or c.model.checkpoint == preset.get("model.checkpoint"):
        return None
    kept = [f"{k}={_get(c, k)!r}" for k in PRESET_TIED if k in preset and preset[k] and _get(c, k) == preset[k]]
    if not kept:
        return None
    return (f"model.checkpoint={c.model.checkpoint} replaces preset {c.preset!r}'s {preset['model.checkpoint']}, "
            f"but the preset's {', '.join(kept)} (chosen for that model) still apply; override them if "
            f"{c.model.checkpoint} expects others")


def _get(c, key: str):
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def override(c: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
    """Set dotted keys ("train.steps") in place, as --config.a.b=value does; returns `c`."""
    for key, value in values.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


# Keys that may differ between a checkpoint's config and the config that resumes it.
RESUMABLE_CHANGES = ("resume", "preset", "log_every", "log.", "train.steps", "train.epochs", "train.nonfinite",
                     "train.max_skipped", "train.stop_grace_s",
                     "data.resume_if_changed", "data.cache_dir", "data.cache_shared", "data.tokenize_workers", "data.step_workers",
                     "data.prefetch",
                     "train.chunk_size", "data.packing", "data.pack_rows_query", "data.pack_rows_passage",
                     "data.pack_rows_negatives", "data.pack_length_query", "data.pack_length_passage",
                     "data.pack_shapes",
                     "checkpoint.", "eval.", "mesh.", "model.remat", "model.remat_memory_gb", "model.dtype",
                     "model.residual_dtype")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys a checkpoint of an earlier infjax lacks, and the value that reproduces how it trained: the comparison on
# resume reads them so (a run that trained without masking may not resume with it, but may with it off).
ADDED_KEYS = {"loss.mask_duplicates": False, "loss.false_negative_margin": None, "loss.matryoshka_dims": "",
              "loss.matryoshka_weights": ""}


def incompatible_changes(saved: dict, current: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) for every key that may not change on resume."""
    a, b = _flatten(saved), _flatten(current)
    a = {**{k: v for k, v in ADDED_KEYS.items() if k not in a and k in b}, **a}
    diffs = []
    for key in sorted(set(a) | set(b)):
        if any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE_CHANGES):
            continue
        if key.startswith("model.lora.") and key not in a and not b.get("model.lora.rank"):
            continue          # saved before LoRA existed: it trained without adapters, as rank 0 does
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append((key, a.get(key, "<absent>"), b.get(key, "<absent>")))
    return diffs


def _names(text: str) -> list[str]:
    """A comma-separated config value as its non-empty items."""
    return [s.strip() for s in text.split(",") if s.strip()]


def eval_specs(c: ml_collections.ConfigDict) -> list[str]:
    return _names(c.eval.sets)


def canary_specs(c: ml_collections.ConfigDict) -> list[str]:
    return _names(c.eval.canary)


def _is_url(path: str) -> bool:
    """An object-store URL (gs://, s3://, ...), as runtime.storage.is_remote reads it."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path))


def _check(cond: bool, key: str, value, why: str) -> None:
    if not cond:
        raise ConfigError(f"config.{key}={value!r}: {why}")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, num_processes: int = 1) -> None:
    """Refuse values that cannot work, naming the key. Cheap: touches no file or device."""
    for key, value in _flatten(c.to_dict()).items():
        _check(not isinstance(value, float) or math.isfinite(value), key, value, "must be a finite number")
    _validate_objective_and_model(c)
    _validate_data(c)
    _validate_training(c)
    _validate_mesh(c, num_devices, num_processes)
    attention.requested()      # the $INFJAX_ATTENTION switch, refused now rather than inside the first step


def _validate_objective_and_model(c) -> None:
    _check(c.objective in OBJECTIVES, "objective", c.objective, f"unknown objective; choose one of {sorted(OBJECTIVES)}")
    _check(c.loss.temperature > 0, "loss.temperature", c.loss.temperature, "must be > 0")
    _check(c.loss.convention in ("paper", "reference"), "loss.convention", c.loss.convention,
           "must be paper or reference")
    _check(not (c.loss.convention == "reference" and c.loss.positive_once), "loss.positive_once",
           c.loss.positive_once, "is fixed by loss.convention='reference'; leave it False")
    _check(c.loss.instruction_negatives >= 0, "loss.instruction_negatives", c.loss.instruction_negatives, "must be >= 0")
    margin = c.loss.false_negative_margin
    _check(margin is None or -2 < margin < 2, "loss.false_negative_margin", margin,
           "is a difference of cosines: between -2 and 2, or None (off)")
    try:
        losses.matryoshka(c.loss.matryoshka_dims, c.loss.matryoshka_weights)
    except ValueError as e:
        key = "loss.matryoshka_weights" if "weights" in str(e) else "loss.matryoshka_dims"
        _check(False, key, c.loss[key.split(".")[1]], str(e))
    if "i" in OBJECTIVES[c.objective][1] and c.model.interaction == "concat":
        _check(c.loss.instruction_negatives >= 1, "loss.instruction_negatives", c.loss.instruction_negatives,
               f"objective {c.objective} uses the I-marginal and needs at least one instruction negative")
    _check(c.model.family in ("auto",) + tuple(FAMILIES), "model.family", c.model.family,
           f"must be auto or one of {list(FAMILIES)}")
    _check(c.model.interaction in ("concat", "cross_attention"), "model.interaction", c.model.interaction,
           "must be concat or cross_attention")
    _check(c.model.pooling in ("auto",) + POOLINGS, "model.pooling", c.model.pooling,
           "must be auto (the family's own), mean, cls or last")
    _check(c.model.dtype in ("float32", "bfloat16"), "model.dtype", c.model.dtype, "must be float32 or bfloat16")
    _check(c.model.residual_dtype in precision.RESIDUAL_DTYPES, "model.residual_dtype", c.model.residual_dtype,
           "must be float32 (as torch.autocast) or compute (the model.dtype)")
    _check(isinstance(c.model.scan_layers, bool), "model.scan_layers", c.model.scan_layers, "must be True or False")
    why = remat_lib.validate(c.model.remat)
    _check(why is None, "model.remat", c.model.remat, why or "")
    _check(isinstance(c.model.remat_memory_gb, (int, float)) and not isinstance(c.model.remat_memory_gb, bool)
           and c.model.remat_memory_gb >= 0, "model.remat_memory_gb", c.model.remat_memory_gb,
           "must be a number of GB >= 0 (0 = the device's own)")
    _check(isinstance(c.model.checkpoint, str) and c.model.checkpoint != "", "model.checkpoint", c.model.checkpoint,
           "must name a local folder, a hub id, or " + EMBEDDED)
    _validate_lora(c.model.lora)


def _validate_lora(lora) -> None:
    _check(isinstance(lora.rank, int) and not isinstance(lora.rank, bool) and lora.rank >= 0, "model.lora.rank",
           lora.rank, "must be an integer >= 0 (0 = off)")
    _check(isinstance(lora.alpha, (int, float)) and lora.alpha > 0, "model.lora.alpha", lora.alpha, "must be > 0")
    _check(isinstance(lora.dropout, (int, float)) and 0 <= lora.dropout < 1, "model.lora.dropout", lora.dropout,
           "must be in [0, 1)")
    names = [t.strip() for t in str(lora.targets).split(",") if t.strip()]
    _check(isinstance(lora.targets, str) and (names == ["all"] or (names and set(names) <= set(LORA_PROJECTIONS))),
           "model.lora.targets", lora.targets, f"must be 'all' or comma-separated names from {list(LORA_PROJECTIONS)}")
    _check(lora.base_dtype in ("auto", "float32", "bfloat16"), "model.lora.base_dtype", lora.base_dtype,
           "must be auto (= model.dtype), float32 or bfloat16")


def _one_of(choices) -> str:
    """"a, b or c" of the choices, in their order."""
    names = list(choices)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def _validate_data(c) -> None:
    _check(c.data.field_map in inf_ir.FIELD_MAPS, "data.field_map", c.data.field_map,
           f"must be {_one_of(inf_ir.FIELD_MAPS)}")
    _check(c.data.on_bad_row in inf_ir.ON_BAD_ROW_CHOICES, "data.on_bad_row", c.data.on_bad_row,
           f"must be {_one_of(inf_ir.ON_BAD_ROW_CHOICES)}")
    _check(isinstance(c.data.dedupe, bool), "data.dedupe", c.data.dedupe, "must be True or False")
    _check(c.data.limit >= 0, "data.limit", c.data.limit, "must be >= 0")
    _check(isinstance(c.data.source, str) and c.data.source.strip() != "", "data.source", c.data.source,
           "must be 'synthetic', a hub id, or local parquet/jsonl/json path(s)")
    if c.data.source != "synthetic":
        _check(any(s.strip() for s in c.data.splits.split(",")), "data.splits", c.data.splits,
               "names no split; give one or more comma-separated InF-IR splits (e.g. msmarco)")
    _validate_mixture(c)
    _check(isinstance(c.data.resume_if_changed, bool), "data.resume_if_changed", c.data.resume_if_changed,
           "must be True or False")
    _check(isinstance(c.data.cache_dir, str) and not _is_url(c.data.cache_dir), "data.cache_dir",
           c.data.cache_dir, "must be a local folder (the token cache is memory-mapped; the workdir may still be on "
           "an object store), or empty for $INFJAX_CACHE_DIR or ~/.cache/infjax")
    _check(isinstance(c.data.cache_shared, bool), "data.cache_shared", c.data.cache_shared, "must be True or False")
    for key in ("tokenize_workers", "step_workers"):
        _check(isinstance(c.data[key], int) and c.data[key] >= -1, f"data.{key}", c.data[key],
               "must be an integer >= -1 (-1 = chosen for this machine, 0 = this process)")
    _check(isinstance(c.data.prefetch, int) and c.data.prefetch >= 1, "data.prefetch", c.data.prefetch,
           "must be an integer >= 1 (steps built ahead of the loop)")
    for key in ("query_max_len", "passage_max_len"):
        _check(8 <= c.data[key] <= 8192, f"data.{key}", c.data[key], "must be in [8, 8192]")
    try:
        validate_template(c.data.query_template)
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None
    _check(c.data.synthetic.num_train >= 1, "data.synthetic.num_train", c.data.synthetic.num_train, "must be >= 1")
    _check(c.data.synthetic.num_eval_queries >= 1, "data.synthetic.num_eval_queries",
           c.data.synthetic.num_eval_queries, "must be >= 1")
    _check(c.data.synthetic.pool_size >= 8, "data.synthetic.pool_size", c.data.synthetic.pool_size, "must be >= 8")
    _check(isinstance(c.data.packing, bool), "data.packing", c.data.packing, "must be True or False")
    for side in ("query", "passage"):
        length = c.data[f"pack_length_{side}"]
        _check(isinstance(length, int) and (length == 0 or length >= c.data[f"{side}_max_len"]),
               f"data.pack_length_{side}", length, f"must be 0 or >= data.{side}_max_len "
               f"({c.data[f'{side}_max_len']}): a row holds at least one whole text")
    _check(isinstance(c.data.pack_shapes, int) and c.data.pack_shapes >= 1, "data.pack_shapes",
           c.data.pack_shapes, "must be an integer >= 1 (compiled shapes of packed batches)")
    for key in ("pack_rows_query", "pack_rows_passage", "pack_rows_negatives"):
        _check(isinstance(c.data[key], int) and c.data[key] >= 0, f"data.{key}", c.data[key],
               "must be an integer >= 0 (0 = measured before the first step)")


def _validate_training(c) -> None:
    """train.*, log.*, checkpoint.*, eval.*"""
    _check(c.train.batch_size >= 1, "train.batch_size", c.train.batch_size, "must be >= 1")
    _check(c.train.steps >= 0, "train.steps", c.train.steps, "must be >= 0 (0 = train.epochs over the data)")
    _check(c.train.epochs >= 1, "train.epochs", c.train.epochs, "must be >= 1")
    _check(c.train.learning_rate > 0, "train.learning_rate", c.train.learning_rate, "must be > 0")
    _check(c.train.warmup_steps >= 0, "train.warmup_steps", c.train.warmup_steps, "must be >= 0")
    _check(c.train.weight_decay >= 0, "train.weight_decay", c.train.weight_decay, "must be >= 0")
    _check(c.train.grad_clip >= 0, "train.grad_clip", c.train.grad_clip, "must be >= 0 (0 = off)")
    _check(isinstance(c.train.stop_grace_s, (int, float)) and c.train.stop_grace_s >= 0, "train.stop_grace_s",
           c.train.stop_grace_s, "must be >= 0 seconds (0 = wait for the checkpoint however long it takes)")
    _check(c.train.nonfinite in ("skip", "stop"), "train.nonfinite", c.train.nonfinite, "must be skip or stop")
    _check(isinstance(c.train.max_skipped, (int, float)) and 0 <= c.train.max_skipped <= 1, "train.max_skipped",
           c.train.max_skipped, "must be a share in [0, 1] (1.0 = never stop for skipped steps)")
    _check(c.log_every >= 1, "log_every", c.log_every, "must be >= 1")
    writers = writer_names(c.log.writers)
    for w in writers:
        _check(w in LOG_WRITERS, "log.writers", c.log.writers, f"unknown writer {w!r}; choose from {list(LOG_WRITERS)}")
    _check("jsonl" in writers, "log.writers", c.log.writers,
           "must include jsonl (metrics.jsonl is the run's own record, trimmed and continued on resume)")
    _check(c.log.wandb_mode in WANDB_MODES, "log.wandb_mode", c.log.wandb_mode,
           "must be online, offline, disabled or '' (the WANDB_MODE environment variable)")
    for key in ("wandb_project", "wandb_entity", "wandb_name"):
        _check(isinstance(c.log[key], str), f"log.{key}", c.log[key], "must be a string")
    _check(c.log.wandb_project != "" and not set(c.log.wandb_project) & set("/\\#?%:"), "log.wandb_project",
           c.log.wandb_project, "must name a W&B project: not empty, none of / \\ # ? % :")
    _check("/" not in c.log.wandb_entity, "log.wandb_entity", c.log.wandb_entity, "must not contain '/'")
    _check(c.checkpoint.every >= 1, "checkpoint.every", c.checkpoint.every, "must be >= 1")
    _check(c.checkpoint.max_to_keep >= 1, "checkpoint.max_to_keep", c.checkpoint.max_to_keep, "must be >= 1")
    _check(c.eval.every >= 0, "eval.every", c.eval.every, "must be >= 0 (0 = only at the end)")
    for key, specs in (("sets", eval_specs(c)), ("canary", canary_specs(c))):
        for spec in specs:
            try:
                parse_spec(spec)
            except DataError as e:
                raise ConfigError(f"config.eval.{key}={c.eval[key]!r}: {e}") from None
    _check(c.eval.canary_margin >= 0, "eval.canary_margin", c.eval.canary_margin, "must be >= 0")
    _check(all(d.strip().isdigit() and int(d) > 0 for d in c.eval.dims.split(",") if d.strip()), "eval.dims",
           c.eval.dims, "must be positive whole numbers, comma-separated (e.g. 128,64)")
    _validate_keep_best(c)
    _check(c.eval.batch_size >= 1, "eval.batch_size", c.eval.batch_size, "must be >= 1")
    _check(c.train.chunk_size >= 0, "train.chunk_size", c.train.chunk_size, "must be >= 0 (0 = off)")
    _check(c.train.moments_dtype in ("float32", "bfloat16"), "train.moments_dtype", c.train.moments_dtype,
           "must be float32 or bfloat16")


def _validate_mixture(c) -> None:
    data = c.data
    _check(data.batch_from in mixture_lib.BATCH_FROM, "data.batch_from", data.batch_from,
           f"must be one of {', '.join(mixture_lib.BATCH_FROM)}")
    _check(data.mixture_alpha >= 0, "data.mixture_alpha", data.mixture_alpha, "must be >= 0 (0 = off)")
    try:
        given = mixture_lib.parse(data.mixture)
    except ValueError as e:
        raise ConfigError(f"config.data.mixture={data.mixture!r}: {e}") from None
    if not given and not data.mixture_alpha:
        _check(data.batch_from != "one_source", "data.batch_from", data.batch_from,
               "needs a mixture of sources: set data.mixture or data.mixture_alpha")
        return
    _check(not (given and data.mixture_alpha), "data.mixture_alpha", data.mixture_alpha,
           "and data.mixture both set the weights: give one")
    _check(data.source != "synthetic", "data.mixture", data.mixture or data.mixture_alpha,
           "needs data.splits of a data.source to mix; the synthetic corpus is one source")
    splits = _names(data.splits)
    if given:
        named = [n for n, _ in given]
        _check(sorted(named) == sorted(splits), "data.mixture", data.mixture,
               f"must weigh exactly the splits of data.splits={data.splits!r} (it names {named})")


def _validate_keep_best(c) -> None:
    try:
        parsed = best_lib.parse(c.checkpoint.keep_best)
    except ValueError as e:
        raise ConfigError(f"config.checkpoint.keep_best={c.checkpoint.keep_best!r}: {e}") from None
    if parsed is None:
        return
    evaluated = [*eval_specs(c), *canary_specs(c), *([SYNTHETIC_SET] if c.eval.synthetic else [])]
    _check(parsed[0] in evaluated, "checkpoint.keep_best", c.checkpoint.keep_best,
           f"names no set the run evaluates: eval.sets, eval.canary and the synthetic split give {evaluated}")
    _check(c.eval.every >= 1, "checkpoint.keep_best", c.checkpoint.keep_best,
           "needs evaluations during training: set config.eval.every (steps between them)")


def _validate_mesh(c, num_devices: int | None, num_processes: int) -> None:
    """mesh.* and the batch / chunk sizes it must split."""
    sizes = {a: c.mesh[a] for a in ("data", "fsdp", "tensor")}
    for axis, size in sizes.items():
        _check(isinstance(size, int) and (size == -1 or size >= 1), f"mesh.{axis}", size,
               "must be -1 (the remaining devices) or >= 1")
    _check(list(sizes.values()).count(-1) <= 1, "mesh", sizes, "at most one axis may be -1")
    rows = c.train.batch_size * (3 if c.data.hard_negatives else 1)
    if num_devices is not None:
        fixed, free = 1, [a for a, size in sizes.items() if size == -1]
        for axis, size in sizes.items():      # blame the first fixed axis that breaks divisibility
            if size == -1:
                continue
            fixed *= size
            _check(num_devices % fixed == 0, f"mesh.{axis}", size,
                   f"mesh {sizes} does not divide the {num_devices} available devices")
        if free:
            sizes[free[0]] = num_devices // fixed
        shards = sizes["data"] * sizes["fsdp"]
        _check(rows % shards == 0, "train.batch_size", c.train.batch_size,
               f"gives {rows} rows per global batch, not divisible by the batch shards "
               f"(mesh.data x mesh.fsdp = {shards})")
        _check(rows % num_processes == 0, "train.batch_size", c.train.batch_size,
               f"gives {rows} rows per global batch, not divisible by the {num_processes} processes")
        if c.train.chunk_size:
            _check(rows % c.train.chunk_size == 0 and c.train.chunk_size % shards == 0, "train.chunk_size",
                   c.train.chunk_size, f"must divide the {rows} rows per global batch and be a multiple of the "
                   f"{shards} batch shards (mesh.data x mesh.fsdp)")
    elif c.train.chunk_size:
        _check(rows % c.train.chunk_size == 0, "train.chunk_size", c.train.chunk_size,
               f"must divide the {rows} rows per global batch")
