"""Low-rank adapters (LoRA, Hu et al. 2021) on the backbones' linear layers.

A targeted Linear layer with kernel W [in, out] computes

    y = x W + b + (alpha / r) * dropout(x) A B,     A [in, r], B [r, out]

with A drawn uniform in +-1/sqrt(in) (PEFT's default) and B = 0, so a fresh
adapter leaves the model exactly as it was. Training differentiates A and B
only: the base weights are constants of the step, so neither their gradients
nor optimizer moments exist (the memory that full fine-tuning spends on them).

Which layers: `LoraSpec.roles`, resolved from `model.lora.targets` for one
family (`resolve_roles`). The user names projections q, k, v, o, gate, up,
down; a family's call sites name roles (`registry.Family.lora_roles`), and a
role that is one fused matrix (ModernBERT's Wqkv = q, k, v and Wi = gate, up)
takes an adapter only when all its parts are named.

Parameters: a targeted layer holds `kernel`, `bias` (as flax's nn.Dense, same
paths) plus `lora_a`, `lora_b`. `split` separates a model's tree into the
trainable part (every adapter, and the Interaction II head) and the frozen
base; `combine` puts them back for the module. `merge` folds the adapters into
the kernels (W + (alpha / r) A B), which is what export and evaluation use.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from infjax.models import precision

# What `model.lora.targets` may name, and the fused roles built from several of them.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
ADAPTER_KEYS = ("lora_a", "lora_b")
TOWERS = ("shared", "query", "passage")    # model trees holding a backbone (models/encoder.py)
BACKBONE = "backbone"                      # the frozen tree's one key: the base every tower shares


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Rank, scale and dropout of the adapters, and the roles (call-site names) of the layers that get one."""

    rank: int
    alpha: float
    dropout: float = 0.0
    roles: frozenset = frozenset()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def applies(self, role: str | None) -> bool:
        return role is not None and role in self.roles


def role_parts(role: str) -> tuple[str, ...]:
    """The projections a role stands for: its own name, or the parts of a fused matrix."""
    return FUSED.get(role, (role,))


def resolve_roles(targets: str, roles: tuple[str, ...], family: str) -> frozenset:
    """The family's roles that `model.lora.targets` ("all", or comma-separated projections) selects.

    ValueError (naming the key and the family) for a projection the family does not have, or for part of a
    fused matrix."""
    names = [t.strip() for t in str(targets).split(",") if t.strip()]
    if names == ["all"]:
        return frozenset(roles)
    unknown = [n for n in names if n not in PROJECTIONS]
    if unknown or not names:
        raise ValueError(f"config.model.lora.targets={targets!r}: expected 'all' or comma-separated names "
                         f"from {list(PROJECTIONS)}")
    has = {p for r in roles for p in role_parts(r)}
    missing = [n for n in names if n not in has]
    if missing:
        raise ValueError(f"config.model.lora.targets={targets!r}: {family} has no {', '.join(missing)} projection "
                         f"(its projections: {', '.join(p for p in PROJECTIONS if p in has)})")
    chosen = set()
    for role in roles:
        parts = role_parts(role)
        named = [p for p in parts if p in names]
        if named and len(named) < len(parts):
            raise ValueError(f"config.model.lora.targets={targets!r}: {family} computes {', '.join(parts)} with one "
                             f"matrix ({role}); name all of them or none")
        if named:
            chosen.add(role)
    return frozenset(chosen)


class LoraDense(precision.Dense):
    """`precision.Dense` (flax's nn.Dense: the same `kernel` and `bias`, the same arithmetic) plus a low-rank
    update."""

    lora: LoraSpec | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        spec = self.lora
        a = self.param("lora_a", nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
                       (x.shape[-1], spec.rank), jnp.float32)
        b = self.param("lora_b", nn.initializers.zeros, (spec.rank, self.features), jnp.float32)
        if spec.dropout > 0 and self.has_rng("dropout"):       # training (a dropout key is given)
            x = nn.Dropout(spec.dropout, deterministic=False)(x)
        dtype = y.dtype
        # The scale alpha / rank is applied in float32 (in bfloat16, 32/3 would be 10.6875, +0.2%), as the merged
        # export applies it: only the product's rounding to the compute dtype differs. Both products give their
        # adapter a float32 gradient (precision.matmul).
        low = precision.matmul(x, a, dtype, out_dtype=jnp.float32) * jnp.float32(spec.scale)
        return y + precision.matmul(low.astype(dtype), b, dtype)


# --------------------------------------------------------------------------
# Parameter trees
# --------------------------------------------------------------------------


def _is_adapter_path(path) -> bool:
    return bool(path) and getattr(path[-1], "key", None) in ADAPTER_KEYS


def has_adapters(tree) -> bool:
    return any(_is_adapter_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def subtree(tree: Mapping, keep) -> dict:
    """The sub-tree of the leaves whose key path `keep` accepts (empty branches dropped)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            sub = subtree(value, lambda path, k=key: keep((k, *path)))
            if sub:
                out[key] = sub
        elif keep((key,)):
            out[key] = value
    return out


def union(a: Mapping, b: Mapping) -> dict:
    """Two trees with disjoint leaves as one."""
    out = dict(a)
    for key, value in b.items():
        out[key] = union(out[key], value) if key in out and isinstance(value, Mapping) else value
    return out


def split(params: Mapping) -> tuple[dict, dict]:
    """(trainable, frozen) of a model tree ({"shared": tree} or {"query", "passage"}, + "interaction").

    Without adapters: (params, {}), everything trains. With them: trainable holds every adapter of every
    tower and the interaction head; frozen is {"backbone": the base without adapters}, taken from the first
    tower (towers start from the same base, so it is stored once)."""
    if not has_adapters(params):
        return dict(params), {}
    trainable = {k: (subtree(v, lambda p: p[-1] in ADAPTER_KEYS) if k in TOWERS else v) for k, v in params.items()}
    first = next(k for k in TOWERS if k in params)
    return trainable, {BACKBONE: subtree(params[first], lambda p: p[-1] not in ADAPTER_KEYS)}


def combine(trainable: Mapping, frozen: Mapping) -> dict:
    """The model tree that `split` took apart (jit-safe: only dicts are built)."""
    if not frozen:
        return dict(trainable)
    base = frozen[BACKBONE]
    return {k: (union(base, v) if k in TOWERS else v) for k, v in trainable.items()}


def adapters_of(tree: Mapping) -> dict:
    """The adapter leaves of a tree (arrays or shapes), nested as in it."""
    return subtree(tree, lambda p: p[-1] in ADAPTER_KEYS)


def init_adapters(abstract: Mapping, rng: jax.Array) -> dict:
    """Adapter values for the adapter leaves of `abstract` (a LoRA module's parameter shapes).

    A uniform in +-1/sqrt(in) (PEFT's kaiming-uniform default; in = the second-to-last dimension, also for stacked
    layers), B zero. Host float32 arrays; each A's draw folds its path into `rng`."""
    adapters = adapters_of(abstract)

    def draw(path, x):
        if path[-1].key == "lora_b":
            return np.zeros(x.shape, np.float32)
        key = jax.random.fold_in(rng, zlib.crc32(jax.tree_util.keystr(path).encode()) % 2**31)
        bound = 1.0 / np.sqrt(x.shape[-2])
        return np.asarray(jax.random.uniform(key, x.shape, jnp.float32, -bound, bound))
    return jax.tree_util.tree_map_with_path(draw, adapters)


def merge(tree: Mapping, spec: LoraSpec) -> dict:
    """A backbone tree with adapters -> the same tree without them, each targeted kernel replaced by
    W + scale * A B (host float32; stacked layers are merged layer by layer)."""
    if not isinstance(tree, Mapping):
        return tree
    if "lora_a" in tree:
        out = {k: v for k, v in tree.items() if k not in ADAPTER_KEYS}
        a, b = (np.asarray(tree[k], np.float32) for k in ADAPTER_KEYS)
        kernel = np.asarray(tree["kernel"], np.float32)
        out["kernel"] = (kernel + np.float32(spec.scale) * np.matmul(a, b)).astype(np.float32)
        return out
    return {k: merge(v, spec) for k, v in tree.items()}


def cast_floating(tree, dtype: Any):
    """Floating leaves of `tree` (arrays or ShapeDtypeStructs) cast to `dtype` (the frozen base's storage)."""
    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype)
        return np.asarray(x).astype(dtype)
    return jax.tree.map(cast, tree)
