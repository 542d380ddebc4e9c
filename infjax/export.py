"""Export a trained run as a Hugging Face + sentence-transformers folder.

    python -m infjax.export --workdir runs/x --out exported/x [--step N] [--overwrite] [--max_shard_size 5GB]
    python -m infjax.export --workdir runs/lora --out exported/lora-adapter --adapter

DIR gets ``config.json`` (the base checkpoint's config, naming the bare
model class and float32), ``model.safetensors`` (or shards plus
``model.safetensors.index.json`` above ``--max_shard_size``), the tokenizer
files with the family's padding side, and the sentence-transformers files
that fix pooling and L2 normalization, so that ``transformers.AutoModel``
and ``sentence_transformers.SentenceTransformer`` load DIR and give the
embeddings infjax gives. A run with separate encoders exports DIR/query and
DIR/passage. DIR/README.md states the query template and prefixes to use.
A LoRA run (model.lora.rank > 0) exports the same way, its adapters merged
into the base weights; with ``--adapter`` DIR is instead a PEFT folder of
the adapters alone (infjax.models.hf.peft), for the base model it names.

Before anything is written the model embeds a few fixed texts: a model whose
embeddings are NaN or inf (its parameters may be finite) is refused.
Everything is written into a temporary folder next to DIR and renamed into
place at the end, so a failure, Ctrl-C, SIGTERM or SIGHUP never leaves a half-written
DIR. Exit code 2 on user errors (no such run or step, non-empty DIR without
--overwrite, a bad size, too little disk), 3 when the disk fills part-way,
143 on SIGTERM, 129 on SIGHUP. --base_checkpoint names a run's base checkpoint that moved.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Mapping

import jax
import numpy as np
from absl import flags

from infjax import cli, errors, losses
from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.errors import UserError
from infjax.inference.probe import check_outputs
from infjax.inference.sources import is_export
from infjax.models import folder as folder_lib
from infjax.models.encoder import EMBEDDED
from infjax.models.hf import files as hf_files, peft
from infjax.models.registry import FAMILIES
from infjax.runtime import checkpoint, platform, storage
from infjax.runtime.restore import check_finite, load_run, parse_step, saved_steps

DEFAULT_MAX_SHARD_SIZE = "5GB"
INTERACTION_FILE = folder_lib.HEAD_FILE    # an Interaction II run's head, beside the encoder folder(s)
MARKER_FILE = folder_lib.EXPORT_MARKER     # written into every export: what --overwrite may replace (`is_export`)
_README_TITLE = "# InF-Embed bi-encoder (exported by infjax)"

# sentence-transformers pooling config key per infjax pooling kind.
_ST_POOLING = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
_ST_POOLING_KEYS = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                    "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


class ExportError(UserError):
    """A user error (bad arguments, existing output); the message says what to change."""


class ExportStopped(errors.RunStopped):
    """An export that had to stop part-way (its disk filled); the message says that --out is unchanged."""


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as in transformers; KiB/MiB/GiB binary); ints pass through."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
        if not m or m.group(2) not in _UNITS:
            raise ExportError(f"--max_shard_size={text!r} is not a size; write e.g. 5GB, 500MB or 1GiB")
        size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size <= 0:
        raise ExportError(f"--max_shard_size={text!r} must be positive")
    return size


# --------------------------------------------------------------------------
# Writing one model folder
# --------------------------------------------------------------------------


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def export_config(hf_config: Mapping[str, Any], architecture: str) -> dict:
    """The base checkpoint's config.json, naming the bare model class and float32 weights."""
    config = dict(hf_config)
    config["architectures"] = [architecture]
    config["dtype"] = "float32"
    if "torch_dtype" in config:
        config["torch_dtype"] = "float32"
    return config


def write_sentence_transformers_files(folder: str, hidden_size: int, pooling: str, max_seq_length: int,
                                      query_prefix: str, passage_prefix: str, truncate_dim: int | None = None) -> None:
    """modules.json (Transformer -> Pooling -> Normalize) and the configs that fix pooling, lengths and (a
    Matryoshka run's, when asked) the dimension sentence-transformers cuts embeddings to."""
    if pooling not in _ST_POOLING:
        raise ExportError(f"pooling {pooling!r} has no sentence-transformers equivalent")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    _write_json(os.path.join(folder, "modules.json"), modules)
    _write_json(os.path.join(folder, "sentence_bert_config.json"),
                {"max_seq_length": int(max_seq_length), "do_lower_case": False})
    _write_json(os.path.join(folder, "config_sentence_transformers.json"),
                {"prompts": {"query": query_prefix, "document": passage_prefix},
                 "default_prompt_name": None, "similarity_fn_name": "cosine",
                 **({"truncate_dim": int(truncate_dim)} if truncate_dim else {})})
    os.makedirs(os.path.join(folder, "1_Pooling"))
    pooling_config = {"word_embedding_dimension": int(hidden_size)}
    pooling_config.update({key: key == _ST_POOLING[pooling] for key in _ST_POOLING_KEYS})
    pooling_config["include_prompt"] = True
    _write_json(os.path.join(folder, "1_Pooling", "config.json"), pooling_config)
    os.makedirs(os.path.join(folder, "2_Normalize"))


def write_tokenizer(folder: str, base_path: str, padding_side: str) -> None:
    """The base checkpoint's tokenizer with infjax's padding side (and pad token) saved into ``folder``."""
    Tokenizer(base_path, padding_side=padding_side).save(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["padding_side"] = padding_side
    _write_json(path, config)


def _check_max_seq_length(max_seq_length: int | None) -> None:
    if max_seq_length is not None and max_seq_length < 1:
        raise ExportError(f"--max_seq_length must be >= 1, got {max_seq_length}")


def inference_length(trained: int, base_path: str, hf_config: Mapping[str, Any]) -> int:
    """The max_seq_length an export declares.

    It is the longer of the training truncation and the base model's own max_seq_length, within its position
    table. Training often truncates harder than the base model reads (the embedded default: 48 tokens, MiniLM's
    own 256). Declaring the training length would make every sentence-transformers user truncate
    documents there, which reads as lost retrieval quality; fine-tuning does not shorten the model."""
    length = max(trained, folder_lib.st_max_seq_length(base_path) or 0)
    positions = hf_config.get("max_position_embeddings")
    return min(length, int(positions)) if isinstance(positions, int) and positions >= trained else length


def base_pooler(base_path: str) -> dict[str, np.ndarray]:
    """The base checkpoint's BERT pooler (`pooler.dense.*`), copied unchanged; {} when the base has none.

    infjax never uses it (it pools token states itself), but `BertModel` has one: without it, every load of the
    export warns that the pooler was "newly initialized", which reads as a broken model."""
    from safetensors import safe_open

    out = {}
    try:
        files = hf_files.safetensors_files(base_path)
    except (OSError, ValueError):
        return out
    for file in files:
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                short = name.removeprefix("bert.")
                if short.startswith("pooler."):
                    out[short] = np.asarray(f.get_tensor(name), np.float32)
    return out


def write_model_folder(folder: str, *, family: str, params: Mapping, hf_config: Mapping[str, Any], base_path: str,
                       pooling: str, padding_side: str, max_seq_length: int, query_prefix: str = "",
                       passage_prefix: str = "", max_shard_size: int = parse_size(DEFAULT_MAX_SHARD_SIZE),
                       truncate_dim: int | None = None) -> None:
    """One loadable folder (HF config + weights + tokenizer + sentence-transformers files) in ``folder``."""
    if family not in FAMILIES:
        raise ExportError(f"family {family!r} cannot be exported; supported: {sorted(FAMILIES)}")
    tensors = FAMILIES[family].to_hf(params, hf_config, os.path.join(base_path, "config.json"))
    if family == "bert":
        tensors = {**base_pooler(base_path), **tensors}
    architecture = FAMILIES[family].architecture
    os.makedirs(folder, exist_ok=True)
    _write_json(os.path.join(folder, "config.json"), export_config(hf_config, architecture))
    hf_files.save_safetensors(folder, tensors, max_shard_size)
    write_tokenizer(folder, base_path, padding_side)
    write_sentence_transformers_files(folder, hf_config["hidden_size"], pooling, max_seq_length,
                                      query_prefix, passage_prefix, truncate_dim)


def write_head(folder: str, head: Mapping) -> None:
    """The Interaction II head (float32 w_i, w_q1, w_q2) as INTERACTION_FILE."""
    hf_files.write_safetensors_file(os.path.join(folder, INTERACTION_FILE),
                                    {k: np.asarray(v, np.float32) for k, v in head.items()}, {"format": "np"})


# --------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------


def interaction_readme(q_folder: str, query_prefix: str) -> str:
    """The README's recipe for the instruction-aware query embedding of an Interaction II export (its head).

    It comes before anything else about queries."""
    return f"""
## Queries: the Interaction II head (read this first)

This run combines instruction and query with the learned head in
`interaction_head.safetensors` (float32 `w_i`, `w_q1`, `w_q2`, each d x d;
infjax.models.interaction). The instruction-aware query embedding is NOT the
encoder's output for one text: encoding `query + " " + instruction` with
sentence-transformers ignores the head and scores another model. Build it from
the instruction I and the query Q encoded apart, each with the query prefix
(`prefix` below):

```python
import torch
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

prefix = {query_prefix!r}
head = load_file("DIR/{INTERACTION_FILE}")
st = SentenceTransformer("{q_folder}")
model, tok = AutoModel.from_pretrained("{q_folder}"), AutoTokenizer.from_pretrained("{q_folder}")
i = st.encode([prefix + I], convert_to_tensor=True)[0]                 # pooled, L2-normalized
t = tok([prefix + Q], return_tensors="pt")
h = model(**t).last_hidden_state[0]                                     # the query's token states
logits = (i @ head["w_i"]) @ (h @ head["w_q1"]).T / h.shape[-1] ** 0.5  # one key per real token
iq = torch.softmax(logits, -1) @ (h @ head["w_q2"])
iq = iq / iq.norm()                                                     # score: iq @ passage embedding
```

`python -m infjax.evaluate --model=DIR ...` evaluates this folder with its head.
"""


def readme_text(*, separate: bool, base: str, family: str, pooling: str, padding_side: str, query_template: str,
                query_prefix: str, passage_prefix: str, query_max_len: int, passage_max_len: int, run: str = "",
                step: int | None = None, max_seq_length: dict[str, int] | None = None, head: bool = False,
                dims: tuple[int, ...] = (), truncate_dim: int | None = None) -> str:
    """A short README: what the folder is and how to build query/passage text.

    With an Interaction II `head` the head's query recipe comes first, and no one-text query recipe is given (it
    would ignore the head)."""
    trained = (f" from run `{run}`" + (f" at step {step}" if step is not None else "")) if run else ""
    lengths = ", ".join(f"{k or 'the folder'}: {v}" for k, v in (max_seq_length or {}).items()) or "as trained"
    if separate:
        layout = ("Two encoders (Hugging Face + sentence-transformers format each): `query/` for\n"
                  "instruction-queries, `passage/` for passages.")
        q_folder, p_folder = "DIR/query", "DIR/passage"
    else:
        layout = ("One encoder for instruction-queries and passages (Hugging Face +\n"
                  "sentence-transformers format).")
        q_folder = p_folder = "DIR"
    intro = f"""{_README_TITLE}

Base checkpoint `{base}` ({family}), fine-tuned with infjax{trained}.
{layout}
Embeddings: {pooling} pooling of the last hidden states ({padding_side} padding),
L2-normalized; score = dot product (= cosine).
"""
    truncation = f"""sentence-transformers truncates at `max_seq_length` ({lengths}): the longer of
the training length and the base model's own.""" + matryoshka_readme(dims, truncate_dim, q_folder)
    if head:
        return intro + interaction_readme(q_folder, query_prefix) + f"""
## Passages

- Passage: `{passage_prefix!r} + passage` (at most {passage_max_len} tokens in training);
  instruction and query at most {query_max_len} tokens each in training.

{truncation}

```python
p_model = SentenceTransformer("{p_folder}")
p = p_model.encode(["..."], prompt_name="document", convert_to_tensor=True)
scores = p @ iq
```
"""
    return intro + f"""
## Text to encode

- Query: `{query_prefix!r} + {query_template!r}.format(instruction=I, query=Q).strip()`
  (instruction and query in one text; at most {query_max_len} tokens in training).
- Passage: `{passage_prefix!r} + passage` (at most {passage_max_len} tokens in training).

{truncation}

The prefixes are stored as sentence-transformers prompts (`query`, `document`);
the template is not, so format the query text yourself:

```python
from sentence_transformers import SentenceTransformer

q_model = SentenceTransformer("{q_folder}")
p_model = SentenceTransformer("{p_folder}")
text = {query_template!r}.format(instruction="...", query="...").strip()
q = q_model.encode([text], prompt_name="query")
p = p_model.encode(["..."], prompt_name="document")
scores = q @ p.T
```
"""


def matryoshka_readme(dims: tuple[int, ...], truncate_dim: int | None, folder: str) -> str:
    """The README's paragraph on a Matryoshka run's dimensions ("" for a run without them)."""
    if not dims:
        return ""
    chosen = (f"\nThis folder sets `truncate_dim` = {truncate_dim} (config_sentence_transformers.json):\n"
              f"sentence-transformers returns {truncate_dim} coordinates unless given another `truncate_dim`.\n"
              if truncate_dim else "")
    return f"""

## Matryoshka dimensions

Trained on the first {", ".join(str(d) for d in dims)} coordinates of each embedding (each prefix
L2-normalized again, losses summed): an embedding cut to one of them keeps most of
its quality. Cut and normalize again, as in training:
{chosen}
```python
model = SentenceTransformer("{folder}", truncate_dim={dims[-1]})
e = model.encode(["..."], normalize_embeddings=True)
```"""


# --------------------------------------------------------------------------
# Atomic output folder
# --------------------------------------------------------------------------


def _resolved(path: str) -> str:
    return path.rstrip("/") if storage.is_remote(path) else os.path.realpath(path)


def _overlaps(a: str, b: str) -> bool:
    """Whether folder `a` is `b`, lies inside `b`, or contains `b` (after resolving links; URLs as written)."""
    a, b = _resolved(a), _resolved(b)
    if storage.is_remote(a) or storage.is_remote(b):
        return a == b or a.startswith(b + "/") or b.startswith(a + "/")
    return os.path.commonpath([a, b]) in (a, b)


def inside_run(out: str) -> str | None:
    """The run folder (one with finished checkpoints) that local folder `out` is or lies inside, or None.

    At any depth, after resolving links and `..`; None too for an object-store URL."""
    if storage.is_remote(out):
        return None
    path = _resolved(out)
    while True:
        with contextlib.suppress(OSError):        # a folder this user cannot list holds no run of theirs
            if saved_steps(path):
                return path
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)


def remove_stale_temporaries(out: str) -> list[str]:
    """Remove the temporary folders of earlier exports to DIR whose process is gone; return them.

    They are `.<DIR>.tmp-<pid>-*` beside DIR (a kill -9 leaves one the size of the model); each removal is
    printed."""
    parent, name = os.path.dirname(out), os.path.basename(out)
    removed = []
    for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        match = re.fullmatch(rf"\.{re.escape(name)}\.tmp-(?:(\d+)-)?\w+", entry)
        path = os.path.join(parent, entry)
        if not match or not os.path.isdir(path) or (match.group(1) and _alive(int(match.group(1)))):
            continue
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        shutil.rmtree(path, ignore_errors=True)
        print(f"removed {path}: the temporary folder of an export to {out} that did not finish "
              f"({size / 2**20:.0f} MiB)", file=sys.stderr)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def through_link(out: str, say: bool = False) -> str:
    """The folder an export to `out` writes: `out` itself, or the folder a symbolic link `out` points to.

    With `exported/latest` pointing to `exported/v3`, v3 is written, so that the link stays a link and names the
    new export (replacing the link by a folder would leave the old export unnamed beside it). `say`: print
    that line."""
    if storage.is_remote(out) or not os.path.islink(out):
        return out
    target = os.path.realpath(out)
    if say:
        print(f"--out={out} is a symbolic link to {target}: the export is written there, and the link kept",
              file=sys.stderr)
    return target


def _check_out(out: str, overwrite: bool, source: str | None = None) -> None:
    """Refuse an --out that export could not write without losing something.

    DIR may be new or empty; a non-empty DIR needs --overwrite and must be an earlier export
    (never a folder export did not write), and with `source` (the run's workdir) DIR must not be
    the run, contain it, or lie inside it at any depth (links and `..` resolved): the run's own
    checkpoint rotation would delete an export inside checkpoints/, and one written as
    checkpoints/<step> would become the run's latest checkpoint. Nor may DIR lie inside another
    run (`inside_run`).
    """
    if storage.exists(out) and not storage.isdir(out):
        raise ExportError(f"--out={out} exists and is not a folder")
    why = storage.unwritable(out)
    if why:
        raise ExportError(f"--out={out}: cannot write there: {why}")
    real = "" if storage.is_remote(out) or _resolved(out) == os.path.normpath(out) else f" (that is {_resolved(out)})"
    if source is not None and _overlaps(out, source):
        raise ExportError(f"--out={out}{real} is, contains or lies inside the run being exported (--workdir="
                          f"{source}); export never writes into a run: choose a folder outside it")
    run = inside_run(out)
    if run is not None:
        raise ExportError(f"--out={out}{real} is or lies inside the run {run} (it has checkpoints/); export never "
                          f"writes into a run: choose a folder outside it")
    if storage.listdir(out):
        if not overwrite:
            raise ExportError(f"--out={out} is not empty; pass --overwrite to replace an earlier export, "
                              f"or choose another folder")
        if not is_export(out):
            raise ExportError(f"--out={out} is not empty and was not written by infjax.export (no {MARKER_FILE}); "
                              f"--overwrite only replaces an earlier export: remove the folder yourself or "
                              f"choose another one")


def _upload(tmp: str, out: str) -> None:
    """Object-store --out: the finished local ``tmp`` folder uploaded in place of an earlier export.

    An earlier export there is deleted first, and the marker file goes last (object stores have no rename: a
    reader that finds the marker finds a complete export)."""
    if storage.exists(out):
        storage.rmtree(out)
    marker = os.path.join(tmp, MARKER_FILE)
    aside = tempfile.mkdtemp(prefix="infjax-export-marker-")
    os.rename(marker, os.path.join(aside, MARKER_FILE))
    try:
        storage.copy_tree(tmp, out)
        storage.copy_tree(aside, out)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _publish(tmp: str, out: str) -> None:
    """Move the finished ``tmp`` folder to ``out``, replacing an existing ``out`` only at the very end."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export_model(out: str, *, family: str, params: Mapping, hf_config: Mapping[str, Any], base_path: str,
                 pooling: str, padding_side: str, query_template: str = "{query} {instruction}",
                 query_prefix: str = "", passage_prefix: str = "", query_max_len: int = 256,
                 passage_max_len: int = 512, overwrite: bool = False,
                 max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, base: str | None = None, run: str = "",
                 step: int | None = None, max_seq_length: int | None = None, dims: tuple[int, ...] = (),
                 truncate_dim: int | None = None) -> str:
    """Write the export of ``params`` ({"shared": tree} or {"query": tree, "passage": tree}) to ``out``.

    ``dims``: the Matryoshka dimensions the run trained (named in the README); ``truncate_dim``: one of them,
    which sentence-transformers then cuts embeddings to by default.

    Each encoder folder declares ``max_seq_length`` tokens to sentence-transformers when given, else
    `inference_length` of its training length (the longer of it and the base model's own).

    Builds everything in a temporary folder next to ``out`` and renames it
    into place; on any failure the temporary folder is removed and ``out`` is
    left as it was. An object-store ``out`` (gs://...) is built in a local
    temporary folder and uploaded (see `_upload`). Returns ``out``.
    """
    out = through_link(storage.absolute(out))
    shard_bytes = parse_size(max_shard_size)
    _check_out(out, overwrite, run or None)
    check_finite(params, f"export of {run or 'the given parameters'}" + (f" step {step}" if step is not None else ""))
    if truncate_dim is not None and truncate_dim not in dims:
        raise ExportError(f"--truncate_dim={truncate_dim}: " + (
            f"the run trained the Matryoshka dimensions {list(dims)}; give one of them" if dims else
            "the run was not trained with loss.matryoshka_dims, so its embeddings were never trained to be cut"))
    extra = sorted(set(params) - {"shared", "query", "passage", "interaction"})
    if extra:
        raise ExportError(f"parameters {extra} have no place in a Hugging Face / sentence-transformers folder")
    head = params.get("interaction")
    _check_max_seq_length(max_seq_length)
    folder_lib.check_lengths(base_path, {"--max_seq_length": max_seq_length}, ExportError, hf_config)
    length = (lambda trained: max_seq_length if max_seq_length else   # noqa: E731
              inference_length(trained, base_path, hf_config))
    if "shared" in params:
        parts = {"": (params["shared"], length(max(query_max_len, passage_max_len)))}
    elif {"query", "passage"} <= set(params):
        parts = {"query": (params["query"], length(query_max_len)),
                 "passage": (params["passage"], length(passage_max_len))}
    else:
        raise ExportError(f"parameters must hold 'shared' or 'query' and 'passage', got {sorted(params)}")

    def write(tmp: str) -> None:
        for sub, (tree, max_len) in parts.items():
            write_model_folder(os.path.join(tmp, sub) if sub else tmp, family=family, params=tree,
                               hf_config=hf_config, base_path=base_path, pooling=pooling,
                               padding_side=padding_side, max_seq_length=max_len, query_prefix=query_prefix,
                               passage_prefix=passage_prefix, max_shard_size=shard_bytes, truncate_dim=truncate_dim)
        if head is not None:
            write_head(tmp, head)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(readme_text(separate="shared" not in params, base=base or base_path, family=family,
                                pooling=pooling,
                                padding_side=padding_side, query_template=query_template,
                                query_prefix=query_prefix, passage_prefix=passage_prefix,
                                query_max_len=query_max_len, passage_max_len=passage_max_len, run=run, step=step,
                                max_seq_length={sub: n for sub, (_, n) in parts.items()}, head=head is not None,
                                dims=dims, truncate_dim=truncate_dim))

    needed = tree_bytes(params) + len(parts) * tokenizer_bytes(base_path)
    return _write_atomically(out, write, {"run": storage.absolute(run) if run else None, "step": step,
                                          "base": base or base_path, "family": family}, needed)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)      # a full disk, a full quota


def tree_bytes(tree) -> int:
    """Bytes of the float32 files an export writes for the arrays of `tree` (it writes float32)."""
    return sum(int(np.prod(np.shape(x))) * 4 for x in jax.tree_util.tree_leaves(tree))


def tokenizer_bytes(base_path: str) -> int:
    """Bytes of the base checkpoint's tokenizer files, which every exported folder gets a copy of."""
    names = [n for n in os.listdir(base_path) if n.startswith(("tokenizer", "vocab", "merges", "special_tokens"))] \
        if os.path.isdir(base_path) else []
    return sum(os.path.getsize(os.path.join(base_path, n)) for n in names)


def check_free_space(out: str, folder: str, needed: int) -> None:
    """Refuse an export that cannot fit on the disk of `folder` (where its temporary folder goes).

    The line names the flag, the folder and the sizes, as training's checks do."""
    free = checkpoint.free_bytes(folder)
    if free < needed:
        raise ExportError(f"--out={out}: {errors.byte_size(free)} free on the disk of {folder}, but the export needs "
                          f"about {errors.byte_size(needed)}; free some space or choose another --out")


def _write_atomically(out: str, write, marker: dict, needed_bytes: int = 0) -> str:
    """Run ``write(tmp)`` on a temporary folder beside ``out``, add the marker file, and put it in place.

    The folder gets the mode the umask gives; it is renamed into place (object stores: uploaded, see `_upload`).
    On any failure, Ctrl-C or SIGTERM the temporary folder is removed and ``out`` is left as it was. An export
    of about ``needed_bytes`` that does not fit is refused before anything is written; a disk that fills while
    writing stops it (ExportStopped) naming --out, the folder and the sizes. Returns ``out``."""
    remote = storage.is_remote(out)
    parent = None if remote else os.path.dirname(out)
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
        remove_stale_temporaries(out)
    check_free_space(out, parent or tempfile.gettempdir(), needed_bytes)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-{os.getpid()}-", dir=parent)
    os.chmod(tmp, 0o777 & ~storage.umask())   # mkdtemp makes 0700; DIR gets the usual permissions
    try:
        write(tmp)
        _write_json(os.path.join(tmp, MARKER_FILE), marker)
        with errors.sigterm_held():           # the renames that put DIR in place are never cut apart
            if remote:
                _upload(tmp, out)
            else:
                _publish(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in FULL_DISK:
            raise
        folder = os.path.dirname(tmp)
        raise ExportStopped(f"--out={out}: the disk of {folder} filled while the export was written "
                            f"({errors.describe(e)}); it needs about {errors.byte_size(needed_bytes)}, "
                            f"{errors.byte_size(checkpoint.free_bytes(folder))} are free now. The unfinished export "
                            f"was removed and --out is as it was; free some space or choose another --out") from None
    except errors.Terminated as e:
        unfinished = os.path.exists(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise errors.Terminated(f"{e}; removed the unfinished export {tmp}, --out={out} is as it was" if unfinished
                                else f"{e} after the export to --out={out} was complete", e.signum) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if remote:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_adapters(out: str, run, workdir: str) -> str:
    """Write a LoRA run's adapters as PEFT folder(s) to ``out``, atomically as `export_model` does.

    DIR, or DIR/query and DIR/passage for separate encoders; an Interaction II head beside them; a README on
    loading them. ``out`` was checked by `_check_out`."""
    if run.lora is None:
        raise ExportError(f"--adapter: the run in {workdir} trained the whole backbone (model.lora.rank=0), so it "
                          f"has no adapters; export it without --adapter")
    family = FAMILIES[run.encoder.family]
    hf_config = hf_files.load_hf_config(run.base_path)
    config = family.config.from_hf_dict(hf_config, os.path.join(run.base_path, "config.json"))
    towers = [t for t in ("shared", "query", "passage") if t in run.adapters]
    checkpoint = run.config.model.checkpoint       # the embedded MiniLM is the hub's all-MiniLM-L6-v2
    base = "sentence-transformers/all-MiniLM-L6-v2" if checkpoint == EMBEDDED else checkpoint

    def write(tmp: str) -> None:
        for tower in towers:
            folder = tmp if tower == "shared" else os.path.join(tmp, tower)
            os.makedirs(folder, exist_ok=True)
            tensors = peft.tensors(run.adapters[tower], family, config)
            hf_files.write_safetensors_file(os.path.join(folder, peft.WEIGHTS_FILE), tensors, {"format": "pt"})
            _write_json(os.path.join(folder, peft.CONFIG_FILE),
                        peft.adapter_config(run.lora, peft.modules_of(tensors), base))
            write_tokenizer(folder, run.base_path, run.encoder.padding_side)
        if "interaction" in run.adapters:
            write_head(tmp, run.adapters["interaction"])
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(adapter_readme(base, run.encoder.family, run.encoder.pooling, run.encoder.padding_side,
                                   run.config.data, [t for t in towers if t != "shared"], run.step,
                                   head="interaction" in run.adapters))
    needed = tree_bytes(run.adapters) + len(towers) * tokenizer_bytes(run.base_path)
    return _write_atomically(out, write, {"run": workdir, "step": run.step, "base": base,
                                          "family": run.encoder.family, "adapter": True}, needed)


def adapter_readme(base: str, family: str, pooling: str, padding_side: str, data, towers: list[str],
                   step: int, head: bool = False) -> str:
    folder = "DIR/query" if towers else "DIR"
    query = (f"Queries are NOT one text: this run combines the instruction and the query, encoded apart (each "
             f"with the prefix {data.query_prefix!r}), with the Interaction II head in `{INTERACTION_FILE}`; the "
             f"merged export (`python -m infjax.export` without `--adapter`) gives the recipe in its README"
             if head else
             f"Query text: `{data.query_prefix!r} + {data.query_template!r}.format(instruction=I, query=Q).strip()`")
    return f"""{_README_TITLE}

LoRA adapters (PEFT format) for `{base}` ({family}), trained with infjax (step {step}).
{"Two adapter folders: `query/` for instruction-queries, `passage/` for passages." if towers else
 "One adapter for instruction-queries and passages."}
They adapt the bare model (`AutoModel`), not a `*ForCausalLM` / `*ForMaskedLM` one.
Embeddings: {pooling} pooling of the last hidden states ({padding_side} padding), L2-normalized.

```python
from peft import PeftModel
from transformers import AutoModel, AutoTokenizer

model = PeftModel.from_pretrained(AutoModel.from_pretrained("{base}"), "{folder}").merge_and_unload()
tokenizer = AutoTokenizer.from_pretrained("{folder}")
```

{query};
passage text: `{data.passage_prefix!r} + passage`. For a sentence-transformers folder with the adapters
merged in, run `python -m infjax.export` without `--adapter`.
"""


def export_run(workdir: str, out: str, step: int | None = None, overwrite: bool = False,
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, max_seq_length: int | None = None,
               adapter: bool = False, base_checkpoint: str | None = None, truncate_dim: int | None = None) -> str:
    """Export the run in ``workdir`` at ``step`` (default: latest; "best": checkpoint.keep_best's) to ``out``; see
    :func:`export_model`.

    A LoRA run exports merged (base + scale * A B in every adapted kernel), or with ``adapter`` as PEFT
    adapters (`export_adapters`). ``base_checkpoint`` names the run's base checkpoint where it is now (it
    moved since the run). The model's embeddings of a few fixed texts must be finite (`check_outputs`)."""
    out_abs, workdir = through_link(storage.absolute(out), say=True), storage.absolute(workdir)
    parse_size(max_shard_size)
    _check_max_seq_length(max_seq_length)
    _check_out(out_abs, overwrite, workdir)          # fail before the (slow) restore
    run = load_run(workdir, step, on_host=True, base=base_checkpoint)   # the parameters only, as host arrays
    data = run.config.data
    check_outputs(run.encoder, run.params, Tokenizer(run.base_path, run.encoder.padding_side),
                  TextFormat(data.query_template, data.query_prefix, data.passage_prefix),
                  f"export of {workdir} step {run.step}")
    if adapter:
        return export_adapters(out_abs, run, workdir)
    config = run.config
    return export_model(
        out_abs, family=run.encoder.family, params=run.params, hf_config=hf_files.load_hf_config(run.base_path),
        base_path=run.base_path, pooling=run.encoder.pooling, padding_side=run.encoder.padding_side,
        query_template=config.data.query_template, query_prefix=config.data.query_prefix,
        passage_prefix=config.data.passage_prefix, query_max_len=config.data.query_max_len,
        passage_max_len=config.data.passage_max_len, overwrite=overwrite, max_shard_size=max_shard_size,
        base=config.model.checkpoint, run=workdir, step=run.step, max_seq_length=max_seq_length,
        dims=losses.matryoshka(config.loss.get("matryoshka_dims", ""), config.loss.get("matryoshka_weights", ""))[0],
        truncate_dim=truncate_dim)


PROG = "python -m infjax.export"


def define_flags(fv: flags.FlagValues) -> None:
    """Every flag of `python -m infjax.export`, into `fv`."""
    flags.DEFINE_string("workdir", None, "run directory (holds checkpoints/<step>); a local folder or an "
                        "object-store URL (gs://bucket/runs/x)", flag_values=fv)
    flags.DEFINE_string("step", None, "checkpoint step, or best (the one checkpoint.keep_best kept; default: the "
                        "latest)", flag_values=fv)
    flags.DEFINE_integer("truncate_dim", None, "a Matryoshka run: one of its loss.matryoshka_dims, which "
                         "sentence-transformers then cuts embeddings to by default (default: the whole embedding)",
                         flag_values=fv)
    flags.DEFINE_string("out", None, "output folder DIR, local or gs://... (must be empty unless --overwrite)",
                        flag_values=fv)
    flags.DEFINE_bool("overwrite", False, "replace a non-empty DIR", flag_values=fv)
    flags.DEFINE_string("max_shard_size", DEFAULT_MAX_SHARD_SIZE, "shard model.safetensors above this size",
                        flag_values=fv)
    flags.DEFINE_integer("max_seq_length", None, "tokens sentence-transformers reads (default: the longer of the "
                         "training length and the base model's own max_seq_length)", flag_values=fv)
    flags.DEFINE_bool("adapter", False, "LoRA runs: write the adapters as a PEFT folder (adapter_config.json + "
                      "adapter_model.safetensors for peft.PeftModel.from_pretrained) instead of a merged model",
                      flag_values=fv)
    flags.DEFINE_string("base_checkpoint", None, "the run's base checkpoint (its model.checkpoint: a folder or hub "
                        "id) where it is now, when it moved since the run was trained", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(PROG, define_flags, sys.argv[1:] if argv is None else argv, doc=__doc__.split("\n\n")[0],
                     required=("workdir", "out"))
    platform.choose()                # before JAX starts its backends: the CPU where a plugin has no hardware
    try:
        with errors.sigterm_raises("during the export"):     # SIGTERM, SIGHUP clean up as Ctrl-C does
            out = export_run(args.workdir, args.out, parse_step(args.step), args.overwrite, args.max_shard_size,
                             args.max_seq_length, args.adapter, args.base_checkpoint, args.truncate_dim)
    except (Exception, KeyboardInterrupt, errors.Terminated) as e:    # noqa: BLE001 - report() re-raises bugs
        code = errors.report("infjax.export", e)
        if code is None:
            raise
        return code
    print(f"exported {args.workdir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
