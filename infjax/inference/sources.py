"""Where the embeddings come from: an infjax run, an export, a sentence-transformers folder, or any HF checkpoint.

    load_model("runs/x")                          # infjax run directory (latest step, or step=N)
    load_model("exported/")                       # a folder with modules.json: encoded by sentence-transformers
    load_model("intfloat/e5-base-v2", query_prefix="query: ", passage_prefix="passage: ")   # HF checkpoint, infjax
    load_model(EMBEDDED)                          # the embedded all-MiniLM-L6-v2, infjax

A source is resolved once (`resolve`) into what it is and who reads it (a `Source`), and `load_model`
dispatches on that: infjax reads a run's parameters (runtime/restore.py) or a folder's (models/encoder.py),
and both end in one tail (`_infjax_model`: lengths against the position table, tokenizer, cut counts,
embedders); sentence-transformers reads on torch the folders that it reads (`_load_sentence_transformers`).

Who reads what:
- a run directory: infjax, with the text format (template, prefixes), lengths and interaction of the run's
  saved config;
- a HF checkpoint (hub id, folder, EMBEDDED): infjax, with the default template `"{query} {instruction}"`
  unless told otherwise, and the pooling its sentence-transformers files name (else the family's), so
  untrained baselines are measured exactly as trained runs;
- a sentence-transformers folder (modules.json; an infjax export, or an export's query/ and passage/ towers,
  queries encoded with the first and passages with the second): sentence-transformers (its own pooling and
  normalization), except that infjax reads it, with its prompts and max_seq_length, where it holds an
  Interaction II head (HEAD_FILE: instruction and query encoded apart, then the head, as the run does), with
  `prefer_infjax` (curate's embedder) where infjax reads it as sentence-transformers does
  (models/folder.py `infjax_reads`), and where sentence-transformers cannot be imported and it is an infjax
  export (saying so); another folder is then refused naming the extra that installs it. `model_type="hf"`
  has infjax read any folder.
Every folder is checked as a whole first (models/folder.py), whichever library reads it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
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
from infjax.models.encoder import EMBEDDED, Encoder, checkpoint_path, load_encoder, passage_params, query_params
from infjax.models.folder import EXPORT_MARKER, HEAD_FILE
from infjax.models.hf import files as hf_files
from infjax.runtime import storage
from infjax.runtime.mesh import default_mesh, put, replicated
from infjax.runtime.restore import BASE_FLAG, NonFiniteParams, check_finite, load_run, saved_steps

log = logging.getLogger("infjax.model_sources")

MODEL_TYPES = ("auto", "run", "sentence_transformers", "hf")
ST_EXTRA = "torch"                             # the extra that installs sentence-transformers (and torch)
DEFAULT_QUERY_MAX_LEN, DEFAULT_PASSAGE_MAX_LEN = 256, 512      # docs/method.md §1.4 reference defaults
# What a source is (`Source.kind`), as messages name it.
KINDS = {"run": "an infjax run directory", "export": "an infjax export",
         "sentence_transformers": "a sentence-transformers folder", "hf": "a Hugging Face checkpoint",
         "embedded": "the embedded all-MiniLM-L6-v2 (a Hugging Face checkpoint)"}


class ModelSourceError(UserError, ValueError):
    """A model source that cannot be loaded as asked; the message names the path or flag."""


@dataclasses.dataclass
class EmbeddingModel:
    """A loaded model: two embedding functions over final texts (already formatted by `fmt`)."""

    name: str                       # the source as given (--model)
    kind: str                       # run | sentence_transformers | hf: who encodes it (meta.json's model_type)
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


# --------------------------------------------------------------------------
# What a source is and who reads it
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """What a model source is and who reads it, decided once (`resolve`)."""

    given: str                     # the source as given (--model): messages name it
    kind: str                      # run | export | sentence_transformers | hf | embedded (KINDS)
    path: str                      # the run directory (absolute), or the local folder (a hub id: its download)
    reader: str                    # infjax | sentence_transformers
    towers: dict = dataclasses.field(default_factory=dict)   # {"shared": folder} or {"query": .., "passage": ..}
    head: str | None = None        # the Interaction II head file beside the encoder(s)
    own_settings: bool = False     # its sentence-transformers prompts and max_seq_length apply to infjax
    why: str = ""                  # why this reader, where the kind alone does not say it (logged)
    warn: bool = False             # `why` is a warning (a reader stands in for a missing one)


def is_export(folder: str) -> bool:
    """Whether `folder` (local, or an object-store URL) was written by infjax.export: it holds EXPORT_MARKER."""
    return storage.exists(storage.join(folder, EXPORT_MARKER))


def sentence_transformers_missing() -> str | None:
    """Why sentence-transformers cannot be imported here, or None when it can.

    A plain, `gpu` or `tpu` install has neither it nor torch."""
    try:
        import sentence_transformers  # noqa: F401 - optional: only sentence-transformers folders need it
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def resolve(source: str, model_type: str = "auto", prefer_infjax: bool = False) -> Source:
    """What `source` is and who reads it (see the module docstring).

    Asked in this order: a run directory, a sentence-transformers folder (modules.json at its top, or in each of
    its two towers), else a HF checkpoint (a hub id is downloaded). `model_type` (MODEL_TYPES) names the kind
    instead of asking. A source that is not there, or that no reader here reads, is refused in one line naming
    it."""
    if model_type not in MODEL_TYPES:
        raise ModelSourceError(f"--model_type={model_type!r}: choose one of {list(MODEL_TYPES)}")
    remote, local, absolute = storage.is_remote(source), os.path.expanduser(source), storage.absolute(source)
    if remote and not saved_steps(absolute):
        raise ModelSourceError(f"--model={source!r}: no infjax run directory there (an object-store --model must "
                               f"be a run directory with checkpoints/<step>)")
    if not remote and not os.path.exists(local) and (source.startswith(("/", ".", "~")) or source.count("/") > 1):
        raise ModelSourceError(f"--model={source!r}: no such folder (expected an infjax run directory, a "
                               f"sentence-transformers folder or a HF checkpoint folder)")
    if model_type == "run" or model_type == "auto" and (remote or os.path.isdir(local) and saved_steps(absolute)):
        return Source(source, "run", absolute, "infjax")   # load_run refuses a folder that holds no run
    folders = folder_lib.towers(local) or {"shared": local}
    if model_type == "sentence_transformers" or model_type == "auto" and os.path.isdir(local) and all(
            os.path.isfile(os.path.join(f, folder_lib.MODULES_FILE)) for f in folders.values()):
        return _sentence_transformers_source(source, local, folders, model_type, prefer_infjax)
    try:
        path = checkpoint_path(source)          # a folder as it is, the embedded MiniLM, or a hub download
    except hf_files.CheckpointNotFound as e:
        raise ModelSourceError(f"--model={source!r}: {e}") from None
    if path != local:
        folders = folder_lib.towers(path) or {"shared": path}
    head = os.path.join(path, HEAD_FILE) if os.path.isfile(os.path.join(path, HEAD_FILE)) else None
    return Source(source, "embedded" if source == EMBEDDED else "hf", path, "infjax", folders, head,
                  own_settings=bool(head or len(folders) > 1 or is_export(path)))


def _sentence_transformers_source(source: str, path: str, folders: dict, model_type: str,
                                  prefer_infjax: bool) -> Source:
    """Who reads the sentence-transformers folder `path` (its encoder folders: `folders`)."""
    export, head = is_export(path), os.path.join(path, HEAD_FILE)
    found = functools.partial(Source, source, "export" if export else "sentence_transformers", path,
                              towers=folders, head=head if os.path.isfile(head) else None)
    if os.path.isfile(head):      # sentence-transformers would encode "query instruction" as one text, no head
        return found("infjax", own_settings=True, why=f"{source} holds an Interaction II head ({HEAD_FILE}): "
                     f"encoded by infjax, instruction and query apart, then the head")
    why = ""
    if prefer_infjax and model_type == "auto":
        cannot = None
        for f in folders.values():           # each folder checked as a whole first (a bad one is refused here)
            folder_lib.check(f, reader="sentence_transformers")
            cannot = folder_lib.infjax_reads(f)
            if cannot:
                cannot = f"infjax does not read {f} as sentence-transformers does: {cannot}"
                break
        if cannot is None:
            return found("infjax", own_settings=True, why=f"{source} is encoded by infjax's own encoder, with its "
                         f"pooling, normalization, prompts and max_seq_length as sentence-transformers reads them")
        why = f"{source} is encoded by sentence-transformers: {cannot}"
    missing = sentence_transformers_missing()
    if missing and model_type == "auto" and export:
        # infjax's encoder reads an export as sentence-transformers does: the same weights, pooling,
        # normalization, prompts and max_seq_length (the export is written from them; its folder is checked)
        return found("infjax", own_settings=True, warn=True, why=(
            f"sentence-transformers is not installed ({missing}), so the infjax export {source} is encoded by "
            f"infjax's own encoder, with the export's pooling, normalization, prompts and max_seq_length; pip "
            f"install -e \".[{ST_EXTRA}]\" to encode it with sentence-transformers instead"))
    if missing:
        raise ModelSourceError(f"--model={source} is a sentence-transformers folder, and sentence-transformers "
                               f"cannot be imported here ({missing}): pip install -e \".[{ST_EXTRA}]\", or "
                               f"encode it with infjax (--model_type=hf: its weights and pooling, no other "
                               f"sentence-transformers module)")
    return found("sentence_transformers", why=why)


# --------------------------------------------------------------------------
# Loading: the flags, the dispatch, the readers and their shared tail
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Asked:
    """What the caller asked beside the source: evaluate's and curate's flags (None: not given)."""

    step: int | None = None
    base_checkpoint: str | None = None
    batch_size: int = 64
    pooling: str | None = None
    query_template: str | None = None
    query_prefix: str | None = None
    passage_prefix: str | None = None
    query_max_len: int | None = None
    passage_max_len: int | None = None
    dtype: str = "float32"
    progress: bool = True
    mesh: object = None            # where infjax encodes (default: runtime.mesh.default_mesh())

    def __post_init__(self):
        if self.batch_size < 1:
            raise ModelSourceError(f"--batch_size={self.batch_size}: must be >= 1")
        for flag, value in (("--query_max_len", self.query_max_len), ("--passage_max_len", self.passage_max_len)):
            if value is not None and not 8 <= value <= 8192:
                raise ModelSourceError(f"{flag}={value}: must be in [8, 8192]")
        if self.pooling is not None and self.pooling not in ("mean", "cls", "last"):
            raise ModelSourceError(f"--pooling={self.pooling!r}: must be mean, cls or last")

    def refuse_what_does_not_apply(self, src: Source) -> None:
        """Refuse, in one line naming them, the flags that do not apply to `src`."""
        for flag, value in (("--step", self.step), (BASE_FLAG, self.base_checkpoint)):
            if value is not None and src.kind != "run":
                raise ModelSourceError(f"{flag}={value} applies to infjax run directories; {src.given!r} is "
                                       f"{KINDS[src.kind]}")
        given = [f for f, v in (("--pooling", self.pooling), ("--query_template", self.query_template),
                                ("--query_prefix", self.query_prefix), ("--passage_prefix", self.passage_prefix))
                 if v is not None]
        if src.kind == "run" and given:
            raise ModelSourceError(f"{', '.join(given)}: a run directory uses its own config's pooling, template "
                                   f"and prefixes ({src.given}); these flags apply to HF checkpoints and "
                                   f"sentence-transformers folders")
        if src.kind != "run":
            self.text_format()                # a template that cannot work
        if self.pooling is not None and src.kind in ("export", "sentence_transformers"):
            raise ModelSourceError("--pooling: a sentence-transformers folder uses its own pooling module; "
                                   "pass --model_type=hf to encode it with infjax and another pooling")

    def text_format(self, prompts: tuple[str | None, str | None] = (None, None)) -> TextFormat:
        """The text format the flags give; a template they give that cannot work is one line naming the flag.

        A folder's own (query, document) `prompts` stand in for the prefixes the flags do not give."""
        query, document = prompts
        try:
            return TextFormat(self.query_template or TextFormat.query_template,
                              self.query_prefix if self.query_prefix is not None else query or "",
                              self.passage_prefix if self.passage_prefix is not None else document or "")
        except ValueError as e:
            raise ModelSourceError(str(e).replace("data.query_template", "--query_template")) from None


def load_model(source: str, *, model_type: str = "auto", step: int | None = None, batch_size: int = 64,
               pooling: str | None = None, query_template: str | None = None, query_prefix: str | None = None,
               passage_prefix: str | None = None, query_max_len: int | None = None,
               passage_max_len: int | None = None, dtype: str = "float32", mesh=None,
               progress: bool = True, base_checkpoint: str | None = None,
               prefer_infjax: bool = False) -> EmbeddingModel:
    """Load `source`: resolved once (`resolve`), then read by the reader it names (see the module docstring).

    Raises ModelSourceError / FileNotFoundError on user errors, one line naming the path or flag.
    `base_checkpoint`: a run's base checkpoint where it is now (it moved since the run). `prefer_infjax`
    (curate's embedder): a sentence-transformers folder that infjax's encoder reads as sentence-transformers does
    (an infjax export, or another with only a Transformer, Pooling and Normalize module) is encoded by infjax."""
    asked = Asked(step, base_checkpoint, batch_size, pooling, query_template, query_prefix, passage_prefix,
                  query_max_len, passage_max_len, dtype, progress, mesh)
    src = resolve(source, model_type, prefer_infjax)
    asked.refuse_what_does_not_apply(src)
    if src.why:
        (log.warning if src.warn else log.info)("%s", src.why)
    if src.reader == "sentence_transformers":
        return _load_sentence_transformers(src, asked)
    read = _read_run(src, asked) if src.kind == "run" else _read_folder(src, asked)
    return _infjax_model(read, asked)


@dataclasses.dataclass(frozen=True)
class _Read:
    """What an infjax reader gives the shared tail (`_infjax_model`)."""

    name: str                      # EmbeddingModel.name: a run's absolute path, a folder as given
    kind: str                      # run | hf
    step: int | None
    encoder: Encoder
    params: dict                   # {"shared"} or {"query", "passage"} (+ "interaction": the head)
    folder: str                    # its tokenizer and config.json
    fmt: TextFormat
    query_max_len: int
    passage_max_len: int
    pairs: bool                    # Interaction II: instruction and query encoded apart, then the head
    key: Callable[[Tokenizer], str]   # the embedding cache's model key, given the tokenizer (on first use)
    synthetic: dict | None = None


def _read_run(src: Source, asked: Asked) -> _Read:
    """A run's parameters at `asked.step`, with the text format, lengths and interaction of its config."""
    run = load_run(src.path, asked.step, mesh=asked.mesh, base=asked.base_checkpoint)
    data, model = run.config.data, run.config.model
    qlen, plen = asked.query_max_len or data.query_max_len, asked.passage_max_len or data.passage_max_len
    interaction = model.get("interaction", "concat")
    settings = f"pooling={run.encoder.pooling}|interaction={interaction}|dtype={model.dtype}|len={qlen}/{plen}"

    def key(tokenizer: Tokenizer) -> str:   # the weights' digest costs a pass over them: on first use
        return f"run:{src.path}|weights={params_digest(run.params)}|{settings}|tokenizer={tokenizer.identity()}"

    return _Read(src.path, "run", run.step, run.encoder, run.params, run.base_path,
                 TextFormat(data.query_template, data.query_prefix, data.passage_prefix), qlen, plen,
                 interaction == "cross_attention", key, data.synthetic.to_dict())


def _read_folder(src: Source, asked: Asked) -> _Read:
    """A folder's encoder(s) and Interaction II head, for the shared tail.

    Its sentence-transformers prompts and max_seq_length apply where `Source.own_settings` says, unless the
    flags give them."""
    first = src.towers.get("query", src.path)
    fmt = asked.text_format(folder_lib.st_prompts(first) if src.own_settings else (None, None))
    if asked.dtype not in ("float32", "bfloat16"):
        raise ModelSourceError(f"--dtype={asked.dtype!r}: must be float32 or bfloat16")
    qlen, plen = asked.query_max_len, asked.passage_max_len
    if src.own_settings:
        qlen = qlen or folder_lib.st_max_seq_length(first)
        plen = plen or folder_lib.st_max_seq_length(src.towers.get("passage", src.path))
    try:
        pooling = asked.pooling or folder_lib.pooling(first) or "auto"     # auto: the family's (models/registry.py)
    except folder_lib.PoolingUnread as e:
        raise ModelSourceError(f"--model={src.given}: {e}; name the pooling to use (--pooling=mean, cls or last), "
                               f"or let sentence-transformers encode the folder (--model_type=sentence_transformers)"
                               ) from None
    params = {}
    for tower, folder in src.towers.items():
        config = ml_collections.ConfigDict({"checkpoint": folder, "family": "auto", "pooling": pooling,
                                            "shared_encoder": True, "dtype": asked.dtype})
        encoder, loaded, _ = load_encoder(config)
        params[tower] = loaded["shared"]
    if src.head:
        params["interaction"] = {k: np.asarray(v, np.float32) for k, v in hf_files.read_safetensors(src.head).items()}
    check_finite(params, f"--model={src.given}")
    max_pos = hf_files.load_hf_config(first).get("max_position_embeddings") or 8192
    qlen, plen = qlen or min(DEFAULT_QUERY_MAX_LEN, max_pos), plen or min(DEFAULT_PASSAGE_MAX_LEN, max_pos)
    # the folder's content (its towers and head included), computed on first use: see inference/identity.py
    settings = f"pooling={encoder.pooling}|dtype={asked.dtype}|len={qlen}/{plen}"
    return _Read(src.given, "hf", None, encoder, params, first, fmt, qlen, plen, src.head is not None,
                 lambda tok: f"hf:{identity.folder_digest(src.path)}|{settings}")


def _infjax_model(read: _Read, asked: Asked) -> EmbeddingModel:
    """The tail every infjax reader shares: what `read` holds as an EmbeddingModel.

    The lengths checked against the position table, the tokenizer, the cut counts, the text embedders and, for
    Interaction II, the pair embedder."""
    qlen, plen = read.query_max_len, read.passage_max_len
    folder_lib.check_lengths(read.folder, {"--query_max_len": qlen, "--passage_max_len": plen}, ModelSourceError)
    tokenizer = Tokenizer(read.folder, padding_side=read.encoder.padding_side)
    cuts = {"query": Cuts(qlen), "passage": Cuts(plen)}
    mesh = asked.mesh if asked.mesh is not None else default_mesh()     # the one load_run defaults to
    params = put(read.params, replicated(mesh))
    qp, pp = query_params(params), passage_params(params)
    embedder = TextEmbedder(read.encoder, mesh, tokenizer, asked.batch_size)
    bars = ("queries", "passages") if asked.progress else (None, None)
    embed_pairs = None
    if read.pairs:       # as in training: (instructions, queries) -> iq through the head (params["interaction"])
        pair = CrossAttentionQueryEmbedder(read.encoder, mesh, tokenizer, read.fmt, asked.batch_size)
        embed_pairs = lambda ins, qs: pair(params, list(ins), list(qs), qlen, cuts["query"])   # noqa: E731
    return EmbeddingModel(read.name, read.kind, read.step, read.fmt, qlen, plen,
                          lambda t: embedder(qp, t, qlen, bars[0], cuts["query"]),
                          lambda t: embedder(pp, t, plen, bars[1], cuts["passage"]), synthetic=read.synthetic,
                          cache_key=functools.partial(read.key, tokenizer), embed_pairs=embed_pairs, cuts=cuts)


def params_digest(params) -> str:
    """16 hex digits over every parameter's path, dtype, shape and bytes.

    Two runs at the same path and step with other weights (a run replaced by another) get other keys. Arrays
    split across processes are gathered first, so every process computes the same digest."""
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


# --------------------------------------------------------------------------
# sentence-transformers on torch
# --------------------------------------------------------------------------


def _load_sentence_transformers(src: Source, asked: Asked) -> EmbeddingModel:
    """A sentence-transformers folder encoded by sentence-transformers on torch.

    A folder of two (query/ and passage/, an export of separate encoders) encodes queries with the first and
    passages with the second."""
    for f in src.towers.values():
        if not os.path.isfile(os.path.join(f, folder_lib.MODULES_FILE)):
            raise ModelSourceError(f"{os.path.join(f, folder_lib.MODULES_FILE)}: file not found "
                                   f"(--model_type=sentence_transformers needs a sentence-transformers folder)")
        folder_lib.check(f, reader="sentence_transformers")
    models = {tower: _sentence_transformer(src.given, f) for tower, f in src.towers.items()}
    q_model, p_model = models.get("query", models.get("shared")), models.get("passage", models.get("shared"))
    # The folder's own prompts become the prefixes unless given; they are applied here, never twice.
    prompts = getattr(q_model, "prompts", {}) or {}
    fmt = asked.text_format((prompts.get("query"), prompts.get("document") or prompts.get("passage")))
    qlen, plen = asked.query_max_len or q_model.max_seq_length, asked.passage_max_len or p_model.max_seq_length

    def embed(model, texts: list[str], cuts: Cuts) -> np.ndarray:
        model.max_seq_length = cuts.max_len
        with st_counting(model, cuts, len(texts)):
            out = model.encode(list(texts), prompt="", batch_size=asked.batch_size, normalize_embeddings=True,
                               convert_to_numpy=True,
                               show_progress_bar=asked.progress and len(texts) > asked.batch_size)
        return np.asarray(out, np.float32)

    key = lambda: f"st:{identity.folder_digest(src.path)}|len={qlen}/{plen}"   # noqa: E731 - see _read_folder
    cuts = {"query": Cuts(qlen), "passage": Cuts(plen)}
    return EmbeddingModel(src.given, "sentence_transformers", None, fmt, qlen, plen,
                          lambda t: embed(q_model, t, cuts["query"]), lambda t: embed(p_model, t, cuts["passage"]),
                          cache_key=key, cuts=cuts)


@contextlib.contextmanager
def st_counting(model, cuts: Cuts, texts: int):
    """While sentence-transformers encodes `texts` texts with `model`, count into `cuts` those max_len cuts.

    The count comes from its own tokenizer's output for each batch (`preprocess`; `tokenize` in older
    sentence-transformers), read by `cut_flags`. Where the batches seen do not add up to the texts (a
    sentence-transformers that tokenizes through another method), the count is unknown, never a guess."""
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
    """`sentence_transformers.SentenceTransformer(folder)`, on the GPU when there is one.

    Its parameters are checked finite; a folder it cannot load is one line naming it."""
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
