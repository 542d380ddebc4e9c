"""What a usable model folder is, and what it holds, decided in one place.

Every entry point that reads a Hugging Face or sentence-transformers folder passes it through `check` before a
library reads it: training's `model.checkpoint` (and a resumed run's base), a run's base when evaluate or export
restores the run (`models.encoder.load_encoder` calls it), evaluate's `--model` and curate's `--embedder`
(`inference.sources`). The libraries fall back silently where a file is missing: transformers builds a 5-token
tokenizer from tokenizer_config.json alone and reads every word as unknown; a Pooling folder that modules.json
names and that is gone leaves mean pooling. So the folder is checked as a whole:

- config.json is a JSON object, and for infjax's encoder its `model_type` is one a family reads
  (models/registry.py);
- the weights, when they are read: model.safetensors, or every shard its index names (hf/files.py); a
  sentence-transformers folder read by sentence-transformers may hold pytorch_model.bin instead;
- a tokenizer: tokenizer.json, vocab.txt, vocab.json with merges.txt, or a sentencepiece .model file, that
  transformers reads;
- the tokenizer agrees with the embedding table (config.json's `vocab_size`, which the weights are checked
  against as they are read): every id it gives is a row of the table (an id past it reads another row, with no
  error), and, where the weights are read, it has at least half as many tokens as the table has rows (a
  tokenizer that reads most words as unknown is not the one these weights were trained with);
- modules.json (a sentence-transformers folder) is a list of modules, and each module has what it needs: the
  Transformer its folder's config.json, a Pooling module its config.json naming a pooling mode, a Dense module
  its config and weights, a module of another type its folder (a Normalize module needs nothing).

A refusal is one line naming the folder, the file and the remedy (`FolderUnusable`, a UserError).

What a folder holds beside that: two towers (`towers`: an export of separate encoders), an Interaction II head
(HEAD_FILE), the marker of an export (EXPORT_MARKER), the prompts and max_seq_length its sentence-transformers
files declare (`st_prompts`, `st_max_seq_length`), its pooling (`pooling`), and whether infjax's encoder reads it
as sentence-transformers does (`infjax_reads`). `check_lengths` refuses a length past its position table.

What a run reads through its tokenizer is recorded (`record`: its `fingerprint`, over its vocabulary and what it
does to a probe text) under TOKENIZER_KEY of the run's saved config; `other_tokenizer` says why a base folder
that now holds another tokenizer is refused (a resume in training/resume.py, a restore in runtime/restore.py).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Mapping

from infjax.errors import UserError
from infjax.models.hf import files as hf_files
from infjax.models.registry import by_model_type

TOKENIZER_KEY = "tokenizer"      # a run's saved config: {"folder", "fingerprint", "tokens"} of its tokenizer
MODULES_FILE = "modules.json"
ST_CONFIG_FILE = "sentence_bert_config.json"
ST_PROMPTS_FILE = "config_sentence_transformers.json"
HEAD_FILE = "interaction_head.safetensors"     # an Interaction II export's head, beside its encoder(s)
EXPORT_MARKER = "infjax-export.json"           # written into every folder infjax.export writes
TOWERS = ("query", "passage")                  # an export of separate encoders: DIR/query and DIR/passage
# The pooling modes of a sentence-transformers Pooling config, and infjax's name for those it computes.
POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                "pooling_mode_lasttoken": "last", "pooling_mode_max_tokens": None,
                "pooling_mode_mean_sqrt_len_tokens": None, "pooling_mode_weightedmean_tokens": None}
POOLING_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last", "last": "last", "max": None,
                 "mean_sqrt_len_tokens": None, "weightedmean": None}
READERS = ("infjax", "sentence_transformers")
MIN_VOCAB_SHARE = 0.5      # a tokenizer has at least this share of the embedding table's rows as tokens
_PROBE = "Infjax probe: Hello WORLD, café naïve 123 -- tokens!"


class FolderUnusable(UserError, ValueError):
    """A model folder that lacks a file, or whose files do not agree; the message names the file."""


@dataclasses.dataclass(frozen=True)
class ModelFolder:
    """A checked folder: its config.json, its tokenizer's size, its sentence-transformers modules.

    `modules` is [] for a plain Hugging Face folder."""

    path: str
    config: dict
    tokens: int                  # ids its tokenizer gives (vocabulary and added tokens)
    modules: list[dict]


def _module_type(module: dict) -> str:
    """The class name of a modules.json entry ("sentence_transformers.models.Pooling" -> "Pooling")."""
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _read_json(file: str, what: str):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise FolderUnusable(f"{file}: cannot be read ({e.strerror or e}); {what}") from None
    except ValueError as e:
        raise FolderUnusable(f"{file}: not valid JSON ({e}); {what}") from None


def tokenizer_files_missing(path: str) -> str | None:
    """What the folder lacks to hold a tokenizer (None: it has one), named as a user looks for it."""
    has = lambda name: os.path.isfile(os.path.join(path, name))   # noqa: E731
    if has("tokenizer.json") or has("vocab.txt") or glob.glob(os.path.join(glob.escape(path), "*.model")):
        return None
    if has("vocab.json") and not has("merges.txt"):
        return "merges.txt (it has vocab.json, which a BPE tokenizer reads with its merges.txt)"
    if has("merges.txt") and not has("vocab.json"):
        return "vocab.json (it has merges.txt, which a BPE tokenizer reads with its vocab.json)"
    if has("vocab.json"):
        return None
    return "tokenizer.json or vocab.txt (nor vocab.json with merges.txt, nor a sentencepiece .model file)"


def load_tokenizer(path: str):
    """The folder's tokenizer as transformers reads it (`AutoTokenizer`, as data/tokenize.py does).

    Its files must be there; where they are not, or transformers cannot read them, one line names the folder."""
    missing = tokenizer_files_missing(path)
    if missing:
        fallback = (": transformers would build a tokenizer of a few special tokens from tokenizer_config.json "
                    "alone and read every word as unknown"
                    if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else "")
        raise FolderUnusable(f"{path}: no {missing}{fallback}; copy the tokenizer files of the model this "
                             f"folder was made from into it")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:   # noqa: BLE001 - a damaged tokenizer file: one line naming the folder
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise FolderUnusable(f"{path}: transformers cannot read its tokenizer ({type(e).__name__}: {first[:200]}); "
                             f"a tokenizer file is damaged or incomplete: copy it again") from None


def fingerprint(tokenizer) -> str:
    """16 hex digits over what the tokenizer gives.

    That is its vocabulary (token -> id, added tokens included), the ids of a probe text with its special tokens,
    and its padding id. Equal for two folders that tokenize alike (whatever their paths, file dates or the
    tokenizers library's way of saving them); another vocabulary, casing or special token changes it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id   # as infjax pads
    h.update(repr((tokenizer(_PROBE)["input_ids"], pad)).encode())
    return h.hexdigest()


def _tokenizer_chosen_by(path: str, config: dict, read_as: str) -> str:
    """The key that chose `read_as`, the class transformers read a folder's tokenizer files with."""
    file = os.path.join(path, "tokenizer_config.json")
    try:
        named = json.load(open(file, encoding="utf-8")).get("tokenizer_class") if os.path.isfile(file) else None
    except (OSError, ValueError, AttributeError):
        named = None
    named = named if isinstance(named, str) and named else None
    if named and named.removesuffix("Fast") == read_as.removesuffix("Fast"):
        return f"tokenizer_config.json's tokenizer_class {named!r}"
    over = f", over tokenizer_config.json's tokenizer_class {named!r}" if named else ""
    return f"config.json's model_type {config.get('model_type')!r}{over}"


def _check_vocabulary(path: str, config: dict, tokenizer, weights: bool) -> None:
    """Refuse a tokenizer that does not fit the embedding table.

    Every id it gives must be a row of the table; with the weights read, it must cover at least MIN_VOCAB_SHARE
    of the table."""
    rows = config.get("vocab_size")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
        return                                   # the family's config check names the key
    largest = max(tokenizer.get_vocab().values(), default=-1)
    where = f"{path}/config.json has vocab_size={rows}"
    if largest >= rows:
        raise FolderUnusable(f"{path}: its tokenizer gives ids up to {largest}, past the embedding table ({where}): "
                             f"they would read other rows. transformers reads the tokenizer files as "
                             f"{type(tokenizer).__name__}, as "
                             f"{_tokenizer_chosen_by(path, config, type(tokenizer).__name__)} says: if that is "
                             f"not this model's, set it to the model's own; else copy the tokenizer files of the "
                             f"model this folder was made from")
    if weights and len(tokenizer) < MIN_VOCAB_SHARE * rows:
        raise FolderUnusable(f"{path}: its tokenizer has {len(tokenizer)} tokens for an embedding table of "
                             f"{rows} rows ({where}): it is not the tokenizer these weights were trained with; copy "
                             f"the tokenizer files of the model this folder was made from")


def read_modules(path: str) -> list[dict]:
    """The modules modules.json names ([] without the file), each with what it needs.

    A module that lacks a file is one line naming the module and the file."""
    file = os.path.join(path, MODULES_FILE)
    if not os.path.isfile(file):
        return []
    remedy = "copy the sentence-transformers files of the model this folder was made from"
    modules = _read_json(file, remedy)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("path", ""), str)
                                                for m in modules):
        raise FolderUnusable(f"{file}: expected a list of modules ({{\"path\", \"type\"}} each); {remedy}")
    for i, module in enumerate(modules):
        kind, sub = _module_type(module), module.get("path", "")
        where = os.path.join(path, sub) if sub else path
        shown = sub.rstrip("/") + "/" if sub else "./"
        named = f"{file} names module {module.get('idx', i)} ({kind or 'no type'}) in {shown}"
        if hf_files.outside(sub):
            raise FolderUnusable(f"{named}, outside the folder: a module is a sub-folder named relative to it; "
                                 f"{remedy}")
        if kind == "Normalize":
            continue                              # no files: sentence-transformers builds it from nothing
        if sub and not os.path.isdir(where):
            raise FolderUnusable(f"{named}, which is missing; {remedy}, or remove the module from {MODULES_FILE}")
        needs = {"Transformer": ["config.json"], "Pooling": ["config.json"], "Dense": ["config.json"]}.get(kind, [])
        for name in needs:
            if not os.path.isfile(os.path.join(where, name)):
                raise FolderUnusable(f"{named}, which has no {name}; {remedy}")
        if kind == "Pooling" and pooling_of(os.path.join(where, "config.json"), remedy) is False:
            raise FolderUnusable(f"{os.path.join(where, 'config.json')}: names no pooling mode "
                                 f"(pooling_mode or pooling_mode_*); {remedy}")
        if kind == "Dense" and not any(os.path.isfile(os.path.join(where, n))
                                       for n in ("model.safetensors", "pytorch_model.bin")):
            raise FolderUnusable(f"{named}, which has no weights (model.safetensors); {remedy}")
    return modules


def pooling_of(config_file: str, remedy: str = "") -> str | None | bool:
    """The pooling a sentence-transformers Pooling config names, in infjax's name (mean | cls | last).

    None for a mode infjax does not compute (max, mean_sqrt_len, weightedmean, or several at once), False for
    none."""
    cfg = _read_json(config_file, remedy or "copy it again")
    if not isinstance(cfg, dict):
        raise FolderUnusable(f"{config_file}: expected a JSON object; {remedy or 'copy it again'}")
    mode = cfg.get("pooling_mode")              # newer sentence-transformers write a single key
    if isinstance(mode, str):
        return POOLING_MODES.get(mode)
    chosen = [key for key in POOLING_KEYS if cfg.get(key)]
    if not chosen:
        return False
    return POOLING_KEYS[chosen[0]] if len(chosen) == 1 else None


class PoolingUnread(FolderUnusable):
    """A Pooling module whose mode infjax does not compute."""


def pooling(path: str) -> str | None:
    """The pooling a sentence-transformers folder names (mean | cls | last), or None: no Pooling module.

    A mode infjax does not compute (max, mean_sqrt_len, weightedmean) is `PoolingUnread`, naming the file."""
    for module in read_modules(path):
        if _module_type(module) == "Pooling":
            file = os.path.join(path, module.get("path", ""), "config.json")
            found = pooling_of(file)
            if not found:
                raise PoolingUnread(f"{file}: a pooling mode infjax does not compute (it computes mean, cls and "
                                    f"last-token pooling)")
            return found
    return None


# What a reader opens at the top of a model folder (the weights too, by their suffix).
READ_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
              "vocab.json", "merges.txt", "added_tokens.json", MODULES_FILE, ST_CONFIG_FILE)
READ_SUFFIXES = (".safetensors", ".model", ".bin")


def _check_readable(path: str) -> None:
    """A file of the folder this user may not read is a permission, said as one (not as a damaged file)."""
    import pwd
    import stat as stat_lib

    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if not (name in READ_FILES or name.endswith(READ_SUFFIXES)) or not os.path.isfile(file):
            continue
        if os.access(file, os.R_OK):
            continue
        st = os.stat(file)
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = f"uid {st.st_uid}"
        try:
            me = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            me = f"uid {os.geteuid()}"
        raise FolderUnusable(f"{file}: this user ({me}) may not read it (owned by {owner}, mode "
                             f"{stat_lib.S_IMODE(st.st_mode):o}): a permission, not a damaged file; ask {owner} to "
                             f"let you read it (chmod a+r), or copy the folder to one of your own")


def _check_weights_fit(path: str, config_file: str, config: dict, family, family_config) -> None:
    """The weights' tensor names and shapes (read from the files' headers) against what config.json makes of
    them, before anything is built: a folder whose config.json names another family or other sizes is one line."""
    problems = family.names.problems(hf_files.tensor_shapes(path), family_config)
    if not problems:
        return
    shown = "; ".join(p if len(p) <= 160 else p[:157] + "...]" for p in problems)
    model_type = config.get("model_type", "bert")
    raise FolderUnusable(f"{config_file}: model_type {model_type!r} and the sizes it gives disagree with the weights "
                         f"of {path} ({shown}); set model_type and the sizes to those of the model the weights "
                         f"are, or copy the folder again")


def check(path: str, *, weights: bool = True, reader: str = "infjax") -> ModelFolder:
    """`path` (a local folder) checked as a whole (see the module docstring) before a library reads it.

    `weights`: the weights will be read (they must be there, and the tokenizer must cover the table); without,
    only config.json and the tokenizer are (a run restored from its own checkpoint, a model of shapes alone).
    `reader`: infjax (its families, safetensors only) or sentence_transformers (any model it reads; its
    weights may be pytorch_model.bin)."""
    if reader not in READERS:
        raise ValueError(f"reader={reader!r}: one of {READERS}")
    if not os.path.isdir(path):
        raise hf_files.CheckpointNotFound(f"{path}: no such folder")
    _check_readable(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FolderUnusable(f"{path}: no config.json; is it a Hugging Face checkpoint folder? (a "
                             f"sentence-transformers folder has its model's config.json at its top)")
    config = _read_json(config_file, "copy it again from the model this folder was made from")
    if not isinstance(config, dict):
        raise FolderUnusable(f"{config_file}: expected a JSON object, found {type(config).__name__}")
    if reader == "infjax":
        try:
            family = by_model_type(config.get("model_type", "bert"), config_file)
            family_config = family.config.from_hf_dict(config, source=config_file)     # the keys the family needs
            if weights:
                hf_files.safetensors_files(path)   # the files (the index's shards); refuses pickles, naming them
        except ValueError as e:
            raise FolderUnusable(str(e)) from None
        if weights:
            _check_weights_fit(path, config_file, config, family, family_config)
    elif weights and not (any(n.endswith(".safetensors") for n in os.listdir(path))
                          or os.path.isfile(os.path.join(path, "pytorch_model.bin"))):
        raise FolderUnusable(f"{path}: no weights (model.safetensors or pytorch_model.bin); copy them from the "
                             f"model this folder was made from")
    elif weights and os.path.isfile(os.path.join(path, hf_files.SAFETENSORS_INDEX)):
        try:                                       # the index's shards, by the rule infjax's reader keeps
            hf_files.safetensors_files(path)
        except ValueError as e:
            raise FolderUnusable(str(e)) from None
    modules = read_modules(path)
    tokenizer = load_tokenizer(path)
    _check_vocabulary(path, config, tokenizer, weights)
    return ModelFolder(path, config, len(tokenizer), modules)


def record(path: str) -> dict:
    """What a run saves of the tokenizer it reads from folder `path` (under TOKENIZER_KEY)."""
    tokenizer = load_tokenizer(path)
    return {"folder": path, "fingerprint": fingerprint(tokenizer), "tokens": len(tokenizer)}


def other_tokenizer(saved: dict | None, current: dict) -> str | None:
    """Why the tokenizer `current` (`record`) is not the one a run recorded, or None.

    None also where nothing was recorded: a checkpoint written by a tool, not by the trainer (a resume refuses
    those, training/resume.py; a restore for export or evaluation reads them)."""
    if not saved or not current or saved.get("fingerprint") in (None, current["fingerprint"]):
        return None
    return (f"the run was trained with the tokenizer of {saved.get('folder')} ({saved.get('tokens')} tokens, "
            f"fingerprint {saved['fingerprint']}), but {current['folder']} now holds another ({current['tokens']} "
            f"tokens, fingerprint {current['fingerprint']}): restore the tokenizer files the run started with")


def infjax_reads(path: str) -> str | None:
    """Why infjax's encoder would not encode the sentence-transformers folder `path` as it does, or None.

    `path` is one that `check` accepted. A reason is a family, a module, a pooling mode or a text setting infjax
    does not have; None: infjax reads it with the same weights, pooling, normalization, prompts and
    max_seq_length, so it may stand in for sentence-transformers."""
    modules = read_modules(path)
    if not modules:
        return f"{path} has no {MODULES_FILE}"
    config = _read_json(os.path.join(path, "config.json"), "copy it again")
    try:
        by_model_type(config.get("model_type", "bert"))
    except ValueError:
        return f"its model_type {config.get('model_type')!r} is not one of infjax's families"
    try:
        hf_files.safetensors_files(path)
    except (hf_files.CheckpointNotFound, ValueError):
        return "its weights are not in safetensors files"
    for module in modules:
        kind, sub = _module_type(module), module.get("path", "")
        if kind == "Transformer" and sub:
            return f"its Transformer module is in {sub}/, not at the folder's top"
        if kind == "Pooling":
            cfg = _read_json(os.path.join(path, sub, "config.json"), "copy it again")
            if pooling_of(os.path.join(path, sub, "config.json")) is None:
                return f"its pooling ({os.path.join(sub, 'config.json')}) is one infjax does not compute"
            if cfg.get("include_prompt", True) is False:
                return "its pooling leaves the prompt out (include_prompt=false)"
        elif kind not in ("Transformer", "Normalize"):
            return f"it has a {kind or 'typeless'} module ({sub or './'}) that infjax does not read"
    if [_module_type(m) for m in modules][:1] != ["Transformer"]:
        return "its first module is not its Transformer"
    st_config = os.path.join(path, ST_CONFIG_FILE)
    if os.path.isfile(st_config):
        cfg = _read_json(st_config, "copy it again")
        if isinstance(cfg, dict) and cfg.get("do_lower_case"):
            return f"it lowercases texts before its tokenizer ({ST_CONFIG_FILE}: do_lower_case)"
    return None


def towers(path: str) -> dict[str, str]:
    """{"query": DIR/query, "passage": DIR/passage} for a folder of two encoders, else {}.

    Such a folder (infjax.export of a run with separate encoders) has no config.json of its own."""
    found = {t: os.path.join(path, t) for t in TOWERS}
    if os.path.isfile(os.path.join(path, "config.json")) or not all(
            os.path.isfile(os.path.join(p, "config.json")) for p in found.values()):
        return {}
    return found


def st_max_seq_length(path: str) -> int | None:
    """The max_seq_length a sentence-transformers folder declares (ST_CONFIG_FILE), or None."""
    try:
        with open(os.path.join(path, ST_CONFIG_FILE), encoding="utf-8") as f:
            value = json.load(f).get("max_seq_length")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def st_prompts(path: str) -> tuple[str | None, str | None]:
    """The (query, document) prompts a sentence-transformers folder declares (None where it declares none)."""
    try:
        with open(os.path.join(path, ST_PROMPTS_FILE), encoding="utf-8") as f:
            prompts = json.load(f).get("prompts") or {}
    except (OSError, ValueError, AttributeError):
        return None, None
    return prompts.get("query") or None, prompts.get("document") or prompts.get("passage") or None


def check_lengths(path: str, lengths: Mapping[str, int | None], error: type[Exception] = FolderUnusable,
                  config: Mapping | None = None) -> None:
    """Refuse a length past the position table of the model in folder `path`, in one line.

    Past its table (config.json's `max_position_embeddings`) an encoder computes NaN or garbage for every token
    from there on. `lengths` maps how the caller names each value (`--query_max_len`,
    `config.data.query_max_len`) to the value (None: not given); the first one past the table raises `error`,
    naming it, the table and the file. `config`: config.json's dict when the caller holds it already. A model
    whose config.json names no table is not checked."""
    table = (config if config is not None else hf_files.load_hf_config(path)).get("max_position_embeddings")
    if not isinstance(table, int):
        return
    for name, value in lengths.items():
        if value is not None and value > table:
            raise error(f"{name}={value} exceeds the model's position table (max_position_embeddings={table} in "
                        f"{path}/config.json); give at most {table}")
