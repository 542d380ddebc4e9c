"""Hugging Face tensor names <-> Flax parameter trees, driven by a family's name map.

A family's model file declares a :class:`NameMap`: a function that yields
``(hf_name, flax_path, transpose)`` for every tensor of the bare HF model
(``transpose`` marks Linear weights: HF ``[out, in]``, Flax ``[in, out]``),
the name prefixes of its task checkpoints (``bert.``, ``model.``), the tensors
an encoder ignores (LM / MLM / pooler heads, stale buffers), and the first
layer that ``scan_layers`` stacks. This module applies it in both directions;
nothing here knows a family.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from infjax.models import attention, layers as L

Entry = tuple[str, tuple[str, ...], bool]      # (HF name, Flax path, transpose)


@dataclasses.dataclass(frozen=True)
class NameMap:
    """How one family's HF checkpoints name their tensors."""

    what: str | Callable[[Any], str]            # the family in messages ("BERT"), or (config) -> it
    entries: Callable[[Any], Iterator[Entry]]   # (family config) -> every tensor of the bare HF model
    module: type                                # the family's Flax module class (parameter shapes)
    prefixes: tuple[str, ...] = ()              # task-model prefixes stripped on import ("bert.", "model.")
    ignorable: re.Pattern | None = None         # HF tensors an encoder does not use
    scanned_from: int = 0                       # first layer stacked under `layers` by scan_layers

    def from_hf(self, tensors: Mapping[str, np.ndarray], config, scan_layers: bool = False) -> dict:
        """HF tensors -> the family's Flax tree for `config` (host float32; stacked when `scan_layers`)."""
        what = self.what(config) if callable(self.what) else self.what
        params = params_from_hf(tensors, self.entries(config), self.shapes(config), what=what,
                                prefixes=self.prefixes, ignorable=self.ignorable)
        count = config.num_hidden_layers - self.scanned_from
        if scan_layers and count > 0:
            params = L.stack_layers(params, self.scanned_from, count)
        return params

    def shapes(self, config) -> dict[tuple[str, ...], tuple[int, ...]]:
        """The parameter shapes of the family's module for `config` (an abstract init, remembered per config:
        a folder's check and its load ask for the same)."""
        try:
            return _shapes_of(self.module, config)
        except TypeError:                           # a config that cannot be a key
            return module_param_shapes(self.module(config))

    def problems(self, shapes_by_name: Mapping[str, tuple[int, ...]], config) -> list[str]:
        """How a checkpoint's tensors (name: shape, from the files' headers) fail to fit `config` ([]: they fit)."""
        return match(shapes_by_name, self.entries(config), self.shapes(config),
                     prefixes=self.prefixes, ignorable=self.ignorable)[1]

    def to_hf(self, params: Mapping, config, prefix: str = "") -> dict[str, np.ndarray]:
        """Flax tree (unrolled or scanned) -> float32 numpy by HF bare-model name, with `prefix` prepended."""
        return params_to_hf(L.unstack_layers(params, self.scanned_from), self.entries(config), prefix)


@functools.lru_cache(maxsize=32)
def _shapes_of(module_class: type, config) -> dict[tuple[str, ...], tuple[int, ...]]:
    return module_param_shapes(module_class(config))


def abstract_params(module, seq_len: int = 1) -> dict:
    """The parameter tree of ``module`` (called as ``module(ids, mask)``) as ShapeDtypeStructs.

    They come from an abstract init: nothing is read or allocated. Same layout as the loaders' (scanned or
    not)."""
    ids = jnp.zeros((1, seq_len), jnp.int32)
    with attention.options(report=False):       # nothing is computed: no attention choice worth a log line
        return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids, jnp.ones_like(ids)))["params"]


def module_param_shapes(module, seq_len: int = 1) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flax parameter shapes of ``module`` (called as ``module(ids, mask)``), from an abstract init."""
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


def match(shapes_by_name: Mapping[str, tuple[int, ...]], name_map: Iterator[Entry],
          shapes: Mapping[tuple[str, ...], tuple[int, ...]], *, prefixes: tuple[str, ...] = (),
          ignorable: re.Pattern | None = None) -> tuple[list[Entry], list[str]]:
    """How HF tensors (by name: shape) fit ``name_map`` and the Flax ``shapes``: (the entries that fit, problems).

    Names may carry one of ``prefixes``. A problem names the missing tensors, the unexpected ones (except those
    matching ``ignorable``) and the shape mismatches; none when every entry fits."""
    found = strip_prefixes(shapes_by_name, prefixes)
    fits, known, missing, bad_shape = [], set(), [], []
    for hf_name, path, transpose in name_map:
        known.add(hf_name)
        if hf_name not in found:
            missing.append(hf_name)
            continue
        got, want = tuple(found[hf_name]), shapes.get(path)
        if (got[::-1] if transpose else got) != want:
            bad_shape.append(f"{hf_name}: expected {tuple(want[::-1]) if transpose and want else want}, got {got}")
            continue
        fits.append((hf_name, path, transpose))
    unexpected = sorted(n for n in found if n not in known and not (ignorable and ignorable.search(n)))
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    if bad_shape:
        problems.append(f"shape mismatches: {bad_shape}")
    return fits, problems


def params_from_hf(tensors: Mapping[str, np.ndarray], name_map: Iterator[Entry],
                   shapes: Mapping[tuple[str, ...], tuple[int, ...]], *, what: str,
                   prefixes: tuple[str, ...] = (), ignorable: re.Pattern | None = None) -> dict:
    """Map HF tensors to an (unrolled) Flax parameter tree through ``name_map``.

    Raises ``ValueError`` with `match`'s problems. Returns host float32 numpy arrays.
    """
    tensors = strip_prefixes(tensors, prefixes)
    fits, problems = match({n: np.shape(t) for n, t in tensors.items()}, name_map, shapes, ignorable=ignorable)
    if problems:
        raise ValueError(f"checkpoint does not match the {what} config; " + "; ".join(problems))
    params: dict = {}
    for hf_name, path, transpose in fits:
        value = np.asarray(tensors[hf_name], dtype=np.float32)
        _set_path(params, path, np.ascontiguousarray(value.T) if transpose else value)
    return params


def params_to_hf(params: Mapping, name_map: Iterator[Entry], prefix: str = "") -> dict[str, np.ndarray]:
    """Inverse of :func:`params_from_hf`: unrolled Flax tree -> float32 numpy by HF name.

    Host float32 parameters are not copied: transposed kernels are views (not contiguous), so that an
    export holds the parameters once; writers make one tensor contiguous at a time."""
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
