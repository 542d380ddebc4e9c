"""Where the embeddings come from: an infjax run, a sentence-transformers folder, or any HF checkpoint.

    load_model("runs/x")                          # infjax run directory (latest step, or step=N)
    load_model("exported/")                       # a folder with modules.json: encoded by sentence-transformers
    load_model("intfloat/e5-base-v2", query_prefix="query: ", passage_prefix="passage: ")   # HF checkpoint, infjax
    load_model(EMBEDDED)                          # the embedded all-MiniLM-L6-v2, infjax

A run directory brings its own text format (template, prefixes) and lengths
from the run's saved config. A HF checkpoint is encoded by infjax with the
default template `"{query} {instruction}"` unless told otherwise, and with
the pooling its sentence-transformers files name (else mean), so untrained
baselines are measured exactly as trained runs. A sentence-transformers
folder is encoded on torch by sentence-transformers itself (its own pooling
and normalization); a `modules.json` folder can also be read by infjax with
`model_type="hf"`. An infjax export of separate encoders (`query/` and
`passage/`) encodes queries with the first and passages with the second; an
export with an Interaction II head (HEAD_FILE) is read by infjax with it,
instruction and query encoded apart, as the run is. Where sentence-transformers
cannot be imported, an infjax export (EXPORT_MARKER) is read by infjax with
its own pooling, prompts and lengths, saying so; another sentence-transformers
folder is refused naming the extra that installs it. With `prefer_infjax`
(curate's embedder), a sentence-transformers folder that infjax reads as
sentence-transformers does is encoded by infjax. Every folder is checked as a
whole first (models/folder.py), whichever library reads it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from typing import Callable

import jax
import ml_collections
import numpy as np

from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.errors import UserError
from infjax.inference import identity
from infjax.inference.embedders import CrossAttentionQueryEmbedder, EmbedFn, PairEmbedFn, TextEmbedder
from infjax.inference.truncation import Cuts, cut_flags
from infjax.models import folder as folder_lib
from infjax.models.hf import files as hf_files
from infjax.models.encoder import checkpoint_path, load_encoder, passage_params, query_params
from infjax.runtime import storage
from infjax.runtime.mesh import default_mesh, put, replicated
from infjax.runtime.restore import BASE_FLAG, NonFiniteParams, check_finite, load_run, saved_steps

log = logging.getLogger("infjax.model_sources")

MODEL_TYPES = ("auto", "run", "sentence_transformers", "hf")
HEAD_FILE = "interaction_head.safetensors"     # an Interaction II export's head (infjax.export writes it)
EXPORT_MARKER = "infjax-export.json"           # written into every export by infjax.export
ST_EXTRA = "torch"                             # the extra that installs sentence-transformers (and torch)
TOWERS = ("query", "passage")                  # an export of separate encoders: DIR/query and DIR/passage
DEFAULT_QUERY_MAX_LEN, DEFAULT_PASSAGE_MAX_LEN = 256, 512      # docs/method.md §1.4 reference defaults


class ModelSourceError(UserError, ValueError):
    """A model source that cannot be loaded as asked; the message names the path or flag."""


@dataclasses.dataclass
class EmbeddingModel:
    """A loaded model: two embedding functions over final texts (already formatted by `fmt`)."""

    name: str                       # the source as given (--model)
    kind: str                       # run | sentence_transformers | hf
    step: int | None
    fmt: TextFormat
    query_max_len: int
    passage_max_len: int
    embed_query: EmbedFn            # texts -> L2-normalized float32 [N, d]
    embed_passage: EmbedFn
    synthetic: dict | None = None   # a run's data.synthetic (defaults of the synthetic dataset)
    # weights + encoding settings: the embedding cache's model key, or a function computing it (on first use:
    # a run's key hashes its parameters, which costs a pass over them)
    cache_key: str | Callable[[], str] = ""
    # (instructions, queries) -> iq embeddings, for models that do not read one text (Interaction II).
    embed_pairs: PairEmbedFn | None = None
    # {"query": Cuts, "passage": Cuts}: what the embedding functions encoded and how many texts max_len cut,
    # counted as they tokenize (None: they do not count)
    cuts: dict[str, Cuts] | None = None

    def key(self) -> str:
        """The embedding cache's model key (computed once)."""
        if callable(self.cache_key):
            self.cache_key = self.cache_key()
        return self.cache_key or self.name

    def reset_cuts(self) -> None:
        """Count the cut texts afresh (one task's)."""
        for c in (self.cuts or {}).values():
            c.reset()

    def pair_encoder(self) -> PairEmbedFn:
        """(instructions, queries) -> instruction-aware query embeddings, whatever the interaction."""
        if self.embed_pairs is not None:
            return self.embed_pairs
        return lambda ins, qs: self.embed_query([self.fmt.query(i, q) for i, q in zip(ins, qs)])

    def describe(self) -> dict:
        return {"model": self.name, "model_type": self.kind, "step": self.step,
                "query_template": self.fmt.query_template, "query_prefix": self.fmt.query_prefix,
                "passage_prefix": self.fmt.passage_prefix, "query_max_len": self.query_max_len,
                "passage_max_len": self.passage_max_len}


def is_run_dir(path: str) -> bool:
    """A run directory (local or on an object store, e.g. gs://bucket/runs/x) with a finished checkpoint."""
    return bool(saved_steps(path))


def tower_folders(folder: str) -> dict[str, str]:
    """{"query": DIR/query, "passage": DIR/passage} for a folder holding two encoders and no model of its own
    (infjax.export of a run with separate encoders), else {}."""
    towers = {t: os.path.join(folder, t) for t in TOWERS}
    if os.path.isfile(os.path.join(folder, "config.json")) or not all(
            os.path.isfile(os.path.join(p, "config.json")) for p in towers.values()):
        return {}
    return towers


def detect_type(source: str) -> str:
    """run (a folder with checkpoints/<step>), sentence_transformers (a folder with modules.json, or its query/
    and passage/ folders with one each), else hf."""
    if storage.is_remote(source):
        return "run" if is_run_dir(source) else "hf"
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        if is_run_dir(path):
            return "run"
        folders = list(tower_folders(path).values()) or [path]
        if all(os.path.isfile(os.path.join(f, "modules.json")) for f in folders):
            return "sentence_transformers"
    return "hf"


def is_export(folder: str) -> bool:
    """Whether `folder` was written by infjax.export (its marker file)."""
    return os.path.isfile(os.path.join(folder, EXPORT_MARKER))


def sentence_transformers_missing() -> str | None:
    """Why sentence-transformers cannot be imported here (a plain, `gpu` or `tpu` install has neither it nor
    torch), or None when it can."""
    try:
        import sentence_transformers  # noqa: F401 - optional: only sentence-transformers folders need it
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def params_digest(params) -> str:
    """16 hex digits over every parameter's path, dtype, shape and bytes: two runs at the same path and step
    with other weights (a run replaced by another) get other keys. Arrays split across processes are gathered
    first, so every process computes the same digest."""
    from jax.experimental import multihost_utils

    h = hashlib.blake2b(digest_size=8)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda x: jax.tree_util.keystr(x[0])):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        array = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{array.dtype}|{array.shape}".encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def _mesh(mesh):
    return mesh if mesh is not None else default_mesh()


def st_max_seq_length(folder: str) -> int | None:
    """The max_seq_length a sentence-transformers folder declares (sentence_bert_config.json), or None."""
    try:
        with open(os.path.join(folder, "sentence_bert_config.json"), encoding="utf-8") as f:
            value = json.load(f).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def st_prompts(folder: str) -> tuple[str | None, str | None]:
    """The (query, document) prompts a sentence-transformers folder declares (None where it declares none)."""
    try:
        with open(os.path.join(folder, "config_sentence_transformers.json"), encoding="utf-8") as f:
            prompts = json.load(f).get("prompts") or {}
    except (OSError, ValueError, AttributeError):
        return None, None
    return prompts.get("query") or None, prompts.get("document") or prompts.get("passage") or None


def side_cuts(qlen: int, plen: int) -> dict[str, Cuts]:
    """A model's two counts of cut texts, queries at `qlen` tokens and passages at `plen`."""
    return {"query": Cuts(qlen), "passage": Cuts(plen)}


def _infjax_embedders(encoder, params, tokenizer, mesh, batch_size: int, qlen: int, plen: int, progress: bool,
                      cuts: dict[str, Cuts]):
    embedder = TextEmbedder(encoder, mesh, tokenizer, batch_size)
    params = put(params, replicated(mesh))
    qp, pp = query_params(params), passage_params(params)
    return (lambda t: embedder(qp, t, qlen, "queries" if progress else None, cuts["query"]),
            lambda t: embedder(pp, t, plen, "passages" if progress else None, cuts["passage"]))


def _pair_embedder(encoder, params, tokenizer, fmt, mesh, batch_size: int, qlen: int, cuts: Cuts):
    """Interaction II: (instructions, queries) -> iq, instruction and query encoded apart, then the head
    (`params["interaction"]`), as in training; `cuts` counts the queries max_len cuts."""
    embedder = CrossAttentionQueryEmbedder(encoder, mesh, tokenizer, fmt, batch_size)
    params = put(params, replicated(mesh))
    return lambda ins, qs: embedder(params, list(ins), list(qs), qlen, cuts)


def load_model(source: str, *, model_type: str = "auto", step: int | None = None, batch_size: int = 64,
               pooling: str | None = None, query_template: str | None = None, query_prefix: str | None = None,
               passage_prefix: str | None = None, query_max_len: int | None = None,
               passage_max_len: int | None = None, dtype: str = "float32", mesh=None,
               progress: bool = True, base_checkpoint: str | None = None,
               prefer_infjax: bool = False) -> EmbeddingModel:
    """Load `source` (see the module docstring). Raises ModelSourceError / FileNotFoundError on user errors.
    `base_checkpoint`: a run's base checkpoint where it is now (it moved since the run). `prefer_infjax`: a
    sentence-transformers folder that infjax's encoder reads as sentence-transformers does (an infjax export,
    or another with only a Transformer, Pooling and Normalize module; models/folder.py `infjax_reads`) is
    encoded by infjax, the others by sentence-transformers."""
    if model_type not in MODEL_TYPES:
        raise ModelSourceError(f"--model_type={model_type!r}: choose one of {list(MODEL_TYPES)}")
    if batch_size < 1:
        raise ModelSourceError(f"--batch_size={batch_size}: must be >= 1")
    for flag, value in (("--query_max_len", query_max_len), ("--passage_max_len", passage_max_len)):
        if value is not None and not 8 <= value <= 8192:
            raise ModelSourceError(f"{flag}={value}: must be in [8, 8192]")
    if pooling is not None and pooling not in ("mean", "cls", "last"):
        raise ModelSourceError(f"--pooling={pooling!r}: must be mean, cls or last")
    expanded = os.path.expanduser(source)
    if storage.is_remote(source) and not is_run_dir(source):
        raise ModelSourceError(f"--model={source!r}: no infjax run directory there (an object-store --model must "
                               f"be a run directory with checkpoints/<step>)")
    if not storage.is_remote(source) and not os.path.exists(expanded) and (
            source.startswith(("/", ".", "~")) or source.count("/") > 1):
        raise ModelSourceError(f"--model={source!r}: no such folder (expected an infjax run directory, a "
                               f"sentence-transformers folder or a HF checkpoint folder)")
    kind = detect_type(source) if model_type == "auto" else model_type
    for flag, value in (("--step", step), (BASE_FLAG, base_checkpoint)):
        if value is not None and kind != "run":
            raise ModelSourceError(f"{flag}={value} applies to infjax run directories; {source!r} is a {kind} source")
    if kind == "run":
        flags = (("--pooling", pooling), ("--query_template", query_template), ("--query_prefix", query_prefix),
                 ("--passage_prefix", passage_prefix))
        given = [f for f, v in flags if v is not None]
        if given:
            raise ModelSourceError(f"{', '.join(given)}: a run directory uses its own config's pooling, template "
                                   f"and prefixes ({source}); these flags apply to HF checkpoints and "
                                   f"sentence-transformers folders")
        return _load_run(source, step, batch_size, query_max_len, passage_max_len, mesh, progress, base_checkpoint)
    try:
        fmt = TextFormat(query_template or TextFormat.query_template,
                         query_prefix if query_prefix is not None else "",
                         passage_prefix if passage_prefix is not None else "")
    except ValueError as e:
        raise ModelSourceError(str(e).replace("data.query_template", "--query_template")) from None
    given = (query_prefix is not None, passage_prefix is not None)
    if kind == "sentence_transformers":
        if pooling is not None:
            raise ModelSourceError("--pooling: a sentence-transformers folder uses its own pooling module; "
                                   "pass --model_type=hf to encode it with infjax and another pooling")
        if os.path.isfile(os.path.join(expanded, HEAD_FILE)):
            # sentence-transformers would encode "query instruction" as one text and ignore the head
            log.info("%s holds an Interaction II head (%s): encoded by infjax, instruction and query apart, "
                     "then the head", source, HEAD_FILE)
            return _load_hf(source, fmt, batch_size, None, query_max_len, passage_max_len, dtype, mesh, progress,
                            given)
        if prefer_infjax and model_type == "auto":
            cannot = _infjax_cannot_read(expanded)
            if cannot is None:
                log.info("%s is encoded by infjax's own encoder, with its pooling, normalization, prompts and "
                         "max_seq_length as sentence-transformers reads them", source)
                return _load_hf(source, fmt, batch_size, None, query_max_len, passage_max_len, dtype, mesh,
                                progress, given, as_sentence_transformers=True)
            log.info("%s is encoded by sentence-transformers: %s", source, cannot)
        missing = sentence_transformers_missing()
        if missing and model_type == "auto" and is_export(expanded):
            # infjax's encoder reads an export as sentence-transformers does: the same weights, pooling,
            # normalization, prompts and max_seq_length (the export is written from them; its folder is checked)
            model = _load_hf(source, fmt, batch_size, None, query_max_len, passage_max_len, dtype, mesh, progress,
                             given)
            log.warning("sentence-transformers is not installed (%s), so the infjax export %s is encoded by infjax's "
                        "own encoder, with the export's pooling, normalization, prompts and max_seq_length; "
                        "pip install -e \".[%s]\" to encode it with sentence-transformers instead", missing, source,
                        ST_EXTRA)
            return model
        if missing:
            raise ModelSourceError(f"--model={source} is a sentence-transformers folder, and sentence-transformers "
                                   f"cannot be imported here ({missing}): pip install -e \".[{ST_EXTRA}]\", or "
                                   f"encode it with infjax (--model_type=hf: its weights and pooling, no other "
                                   f"sentence-transformers module)")
        return _load_sentence_transformers(source, fmt, batch_size, query_max_len, passage_max_len, progress, given)
    return _load_hf(source, fmt, batch_size, pooling, query_max_len, passage_max_len, dtype, mesh, progress, given)


def _infjax_cannot_read(folder: str) -> str | None:
    """Why infjax's encoder would not encode the sentence-transformers folder (or each of its two towers) as
    sentence-transformers does, or None; each folder checked as a whole first (a bad one is refused here)."""
    for f in (tower_folders(folder) or {"shared": folder}).values():
        folder_lib.check(f, reader="sentence_transformers")
        why = folder_lib.infjax_reads(f)
        if why:
            return f"infjax does not read {f} as sentence-transformers does: {why}"
    return None


def check_lengths(model_path: str, qlen: int, plen: int) -> None:
    """Refuse a query or passage length beyond the model's position table (as training does): past it an
    encoder computes NaN or garbage for every token from there on."""
    table = hf_files.load_hf_config(model_path).get("max_position_embeddings")
    for flag, value in (("--query_max_len", qlen), ("--passage_max_len", plen)):
        if isinstance(table, int) and value > table:
            raise ModelSourceError(f"{flag}={value} exceeds the model's position table (max_position_embeddings="
                                   f"{table} in {model_path}/config.json); give at most {table}")


def _load_run(workdir, step, batch_size, qlen, plen, mesh, progress, base=None) -> EmbeddingModel:
    workdir = storage.absolute(workdir)
    if not is_run_dir(workdir):
        raise ModelSourceError(f"{workdir} is not an infjax run directory: no checkpoints/<step> inside")
    mesh = _mesh(mesh)
    run = load_run(workdir, step, mesh=mesh, base=base)
    data = run.config.data
    fmt = TextFormat(data.query_template, data.query_prefix, data.passage_prefix)
    qlen, plen = qlen or data.query_max_len, plen or data.passage_max_len
    check_lengths(run.base_path, qlen, plen)
    tokenizer = Tokenizer(run.base_path, padding_side=run.encoder.padding_side)
    cuts = side_cuts(qlen, plen)
    eq, ep = _infjax_embedders(run.encoder, run.params, tokenizer, mesh, batch_size, qlen, plen, progress, cuts)
    interaction = run.config.model.get("interaction", "concat")
    embed_pairs = None
    if interaction == "cross_attention":      # Interaction II: instruction and query encoded apart, then the head
        embed_pairs = _pair_embedder(run.encoder, run.params, tokenizer, fmt, mesh, batch_size, qlen, cuts["query"])
    settings = f"pooling={run.encoder.pooling}|interaction={interaction}|dtype={run.config.model.dtype}" \
               f"|len={qlen}/{plen}|tokenizer={tokenizer.identity()}"
    key = lambda: f"run:{workdir}|weights={params_digest(run.params)}|{settings}"   # noqa: E731
    return EmbeddingModel(workdir, "run", run.step, fmt, qlen, plen, eq, ep, synthetic=data.synthetic.to_dict(),
                          cache_key=key, embed_pairs=embed_pairs, cuts=cuts)


def _load_hf(source, fmt, batch_size, pooling, qlen, plen, dtype, mesh, progress,
             prefixes_given=(True, True), as_sentence_transformers=False) -> EmbeddingModel:
    """A HF checkpoint encoded by infjax; an infjax export folder as well: its query/ and passage/ encoders
    (separate towers) and its Interaction II head (HEAD_FILE) when it has them, its prompts as prefixes
    unless the flags give them (`prefixes_given`). `as_sentence_transformers`: a sentence-transformers folder
    that infjax reads as sentence-transformers does (its prompts and max_seq_length, as for an export)."""
    if dtype not in ("float32", "bfloat16"):
        raise ModelSourceError(f"--dtype={dtype!r}: must be float32 or bfloat16")
    try:
        path = checkpoint_path(source)
    except hf_files.CheckpointNotFound as e:
        raise ModelSourceError(f"--model={source!r}: {e}") from None
    folders = tower_folders(path) or {"shared": path}
    head_file = os.path.join(path, HEAD_FILE)
    head = os.path.isfile(head_file)
    first = folders.get("query", path)
    if as_sentence_transformers or head or len(folders) > 1 or is_export(path):   # its own prompts and lengths
        prompts = st_prompts(first)
        fmt = dataclasses.replace(fmt, query_prefix=fmt.query_prefix if prefixes_given[0] else prompts[0] or "",
                                  passage_prefix=fmt.passage_prefix if prefixes_given[1] else prompts[1] or "")
        qlen = qlen or st_max_seq_length(first)
        plen = plen or st_max_seq_length(folders.get("passage", path))
    try:
        pooling = pooling or folder_lib.pooling(first) or "auto"     # auto: the family's own (models/registry.py)
    except folder_lib.PoolingUnread as e:
        raise ModelSourceError(f"--model={source}: {e}; name the pooling to use (--pooling=mean, cls or last), or "
                               f"let sentence-transformers encode the folder (--model_type=sentence_transformers)") \
            from None
    params = {}
    for tower, folder in folders.items():
        config = ml_collections.ConfigDict({"checkpoint": folder, "family": "auto", "pooling": pooling,
                                            "shared_encoder": True, "dtype": dtype})
        encoder, loaded, _ = load_encoder(config)
        params[tower] = loaded["shared"]
    if head:
        params["interaction"] = {k: np.asarray(v, np.float32) for k, v in hf_files.read_safetensors(head_file).items()}
    check_finite(params, f"--model={source}")
    pooling = encoder.pooling                                 # "auto" resolved
    max_pos = hf_files.load_hf_config(first).get("max_position_embeddings") or 8192
    qlen = qlen or min(DEFAULT_QUERY_MAX_LEN, max_pos)
    plen = plen or min(DEFAULT_PASSAGE_MAX_LEN, max_pos)
    check_lengths(first, qlen, plen)
    tokenizer = Tokenizer(first, padding_side=encoder.padding_side)
    cuts = side_cuts(qlen, plen)
    eq, ep = _infjax_embedders(encoder, params, tokenizer, _mesh(mesh), batch_size, qlen, plen, progress, cuts)
    embed_pairs = _pair_embedder(encoder, params, tokenizer, fmt, _mesh(mesh), batch_size, qlen,
                                 cuts["query"]) if head else None
    # the folder's content (its towers and head included), computed on first use: see inference/identity.py
    key = lambda: f"hf:{identity.folder_digest(path)}|pooling={pooling}|dtype={dtype}|len={qlen}/{plen}"  # noqa: E731
    return EmbeddingModel(source, "hf", None, fmt, qlen, plen, eq, ep, cache_key=key, embed_pairs=embed_pairs,
                          cuts=cuts)


def _load_sentence_transformers(source, fmt, batch_size, qlen, plen, progress, prefixes_given) -> EmbeddingModel:
    """A sentence-transformers folder encoded by sentence-transformers on torch; a folder of two (query/ and
    passage/, an export of separate encoders) encodes queries with the first and passages with the second."""
    folder = os.path.expanduser(source)
    folders = tower_folders(folder) or {"shared": folder}
    for f in folders.values():
        if not os.path.isfile(os.path.join(f, "modules.json")):
            raise ModelSourceError(f"{os.path.join(f, 'modules.json')}: file not found "
                                   f"(--model_type=sentence_transformers needs a sentence-transformers folder)")
        folder_lib.check(f, reader="sentence_transformers")
    models = {tower: _sentence_transformer(source, f) for tower, f in folders.items()}
    q_model, p_model = models.get("query", models.get("shared")), models.get("passage", models.get("shared"))
    # The folder's own prompts become the prefixes unless given; they are applied here, never twice.
    prompts = getattr(q_model, "prompts", {}) or {}
    if not prefixes_given[0] and prompts.get("query"):
        fmt = dataclasses.replace(fmt, query_prefix=prompts["query"])
    if not prefixes_given[1] and (prompts.get("document") or prompts.get("passage")):
        fmt = dataclasses.replace(fmt, passage_prefix=prompts.get("document") or prompts.get("passage"))
    qlen, plen = qlen or q_model.max_seq_length, plen or p_model.max_seq_length

    def embed(model, texts: list[str], cuts: Cuts) -> np.ndarray:
        model.max_seq_length = cuts.max_len
        with st_counting(model, cuts, len(texts)):
            out = model.encode(list(texts), prompt="", batch_size=batch_size, normalize_embeddings=True,
                               convert_to_numpy=True, show_progress_bar=progress and len(texts) > batch_size)
        return np.asarray(out, np.float32)

    key = lambda: f"st:{identity.folder_digest(folder)}|len={qlen}/{plen}"   # noqa: E731 - see _load_hf
    cuts = side_cuts(qlen, plen)
    return EmbeddingModel(source, "sentence_transformers", None, fmt, qlen, plen,
                          lambda t: embed(q_model, t, cuts["query"]), lambda t: embed(p_model, t, cuts["passage"]),
                          cache_key=key, cuts=cuts)


@contextlib.contextmanager
def st_counting(model, cuts: Cuts, texts: int):
    """While sentence-transformers encodes `texts` texts with `model`, count into `cuts` those max_len cuts, from
    its own tokenizer's output for each batch (`preprocess`; `tokenize` in older sentence-transformers), read by
    `cut_flags`. Where the batches seen do not add up to the texts (a sentence-transformers that tokenizes
    through another method), the count is unknown, never a guess."""
    name = "preprocess" if hasattr(type(model), "preprocess") else "tokenize"
    own = getattr(model, name)
    seen = Cuts(cuts.max_len)

    def lengths(batch: list[str]) -> list[int]:
        return [len(ids) for ids in model.tokenizer(list(batch), truncation=False, verbose=False)["input_ids"]]

    def counted(inputs, *args, **kwargs):
        features = own(inputs, *args, **kwargs)
        batch = list(inputs)
        seen.add_flags(cut_flags(features, batch, cuts.max_len, lengths) if all(isinstance(t, str) for t in batch)
                       else None, len(batch))
        return features

    setattr(model, name, counted)          # this model's batches only, for this call only
    try:
        yield
    finally:
        delattr(model, name)
    if seen.texts != texts:
        log.warning("sentence-transformers tokenized %d texts through %s.%s for %d encoded: their count of texts "
                    "cut at %d tokens is unknown", seen.texts, type(model).__name__, name, texts, cuts.max_len)
    cuts.add(texts, seen.cut_count if seen.texts == texts else None)


def _sentence_transformer(source: str, folder: str):
    """`sentence_transformers.SentenceTransformer(folder)` (on the GPU when there is one), its parameters
    checked finite; a folder it cannot load is one line naming it."""
    from sentence_transformers import SentenceTransformer   # optional: only sentence-transformers folders need it

    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - sentence-transformers needs torch
        device = "cpu"
    try:
        model = SentenceTransformer(folder, device=device)
    except Exception as e:   # noqa: BLE001 - a damaged weight file, a broken config: one line naming the folder
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise ModelSourceError(f"--model={source}: sentence-transformers cannot load {folder} "
                               f"({type(e).__name__}: {first[:200]}); a weight or config file is damaged or "
                               f"incomplete: copy or download it again") from None
    for name, tensor in model.named_parameters():
        if not bool(tensor.isfinite().all()):
            raise NonFiniteParams(f"--model={source}: parameter {name} holds {int((~tensor.isfinite()).sum())} "
                                  f"non-finite value(s) of {tensor.numel()}; the model is broken")
    return model
