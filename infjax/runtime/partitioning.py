"""Parameter sharding: ordered regex -> PartitionSpec rules per backbone family (docs/method.md §6.1).

The rules themselves are each family's `partition_rules` in infjax/models/registry.py.

A parameter's path is its keys joined by "/" (e.g. "shared/layer_3/attention/query/kernel").
The FIRST rule whose regex `re.search`es the path gives its PartitionSpec; a path no rule
matches raises, naming the parameter (never a silent replication). Specs name the trailing
dimensions: a scanned stack of layers (leading layer dimension) gets an unsharded leading
dimension. A dimension whose size the mesh axes do not divide is left unsharded on that axis
(e.g. BERT's 30522-word vocabulary on fsdp=4), so every rule works on every mesh.

Kernels are [in, out]: input projections shard (in over fsdp, out over tensor), output
projections the reverse; embeddings shard the hidden dimension over fsdp (and the vocabulary
over tensor); norms and biases are replicated (q/k/v biases follow their kernel's tensor axis).
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from infjax.errors import UserError
from infjax.models import registry

# Shared by every family: the Interaction II head (three d x d matrices) and LoRA's adapters (A [in, r],
# B [r, out]: a few MB per layer) are small and replicated.
HEAD_RULES = ((r"^interaction/", P()), (r"/lora_[ab]$", P()))


class NoRuleError(UserError, ValueError):
    """A parameter that no partition rule matches; the message names it."""


def rules_for(module) -> tuple:
    """The partition rules of the backbone family whose module this is (models/registry.py)."""
    try:
        return registry.of_module(module).partition_rules
    except ValueError as e:
        raise NoRuleError(str(e)) from None


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def spec_for(path: str, shape: tuple[int, ...], rules, mesh: Mesh | None = None) -> P:
    """The first matching rule's spec, fitted to `shape` (leading stacked dims unsharded, and
    axes that do not divide a dimension dropped when `mesh` is given)."""
    for pattern, spec in rules:
        if re.search(pattern, path):
            break
    else:
        raise NoRuleError(f"no partition rule matches parameter {path!r} (shape {tuple(shape)}); "
                          f"add one to its family's partition_rules in infjax/models/registry.py")
    spec = tuple(spec)[:len(shape)]
    spec = (None,) * (len(shape) - len(spec)) + spec
    if mesh is not None:
        fitted = []
        for dim, axes in zip(shape, spec):
            names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
            names = tuple(a for a in names if mesh.shape[a] > 1)
            size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
            fitted.append(None if not names or dim % size else (names[0] if len(names) == 1 else names))
        spec = tuple(fitted)
    return P(*spec)


def param_specs(params, module, mesh: Mesh | None = None):
    """A PartitionSpec per parameter leaf (same tree structure as `params`)."""
    rules = HEAD_RULES + rules_for(module)
    return jax.tree_util.tree_map_with_path(lambda path, x: spec_for(path_str(path), np.shape(x), rules, mesh),
                                            params)


def param_shardings(params, module, mesh: Mesh):
    """NamedShardings of the parameters on `mesh` (params may be arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, module, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def like_params(tree, params, shardings, default):
    """Shardings for a tree whose leaves mirror parameters (optimizer moments): a leaf whose key path
    ends with a parameter's path and has its shape gets that parameter's sharding, others `default`."""
    by_path = {}
    for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(
            shardings, is_leaf=lambda y: isinstance(y, NamedSharding))):
        by_path[path_str(path)] = (tuple(np.shape(x)), s)

    def pick(path, x):
        keys = path_str(path).split("/")
        for i in range(len(keys)):
            hit = by_path.get("/".join(keys[i:]))
            if hit is not None and hit[0] == tuple(np.shape(x)):
                return hit[1]
        return default
    return jax.tree_util.tree_map_with_path(pick, tree)
