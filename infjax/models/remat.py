"""What a layer keeps for the backward pass and what it recomputes: `model.remat`, one policy per run.

A layer's backward pass needs activations of its forward pass. Keeping them all costs memory; recomputing them
costs time. The policies, from most memory to least:

- ``none``: keep everything, recompute nothing (no rematerialisation).
- ``dots``: keep the output of every projection (attention q/k/v/o, the MLP's gate/up/down) and the attention
  output; recompute the elementwise work between them (norms, activations, rotary embeddings, residual sums)
  and what an attention kernel keeps internally.
- ``dots_except_mlp``: as ``dots``, but the MLP's projections are recomputed too (they are the widest).
- ``offload``: as ``dots``, but what is kept waits in pinned host memory, not on the device (where the
  platform has such memory; elsewhere the run warns once and uses ``full``). It costs transfers, not compute,
  which no compiled figure prices: ``auto`` never picks it.
- ``full``: keep only each layer's input; recompute the whole layer (the most recompute, the least memory).

Projections and the attention output are named where they are computed (`tag`: `layers.dense`, and
`attention.attention`), so a policy is a set of names, the same for every family. A policy changes what is
computed twice, never what is computed: losses and gradients equal ``none``'s to float32 rounding
(tests/models/test_remat.py). It holds no state: a run may resume under another policy.
"""
from __future__ import annotations

import logging
from typing import Any

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from infjax.models import kernels

log = logging.getLogger("infjax")

# From the least recompute to the most; `auto` (training/remat_choice.py) tries them in this order.
RECOMPUTE_ORDER = ("none", "dots", "dots_except_mlp", "full")
POLICIES = ("none", "dots", "dots_except_mlp", "offload", "full")
CHOICES = POLICIES + ("auto",)

ATTENTION_ROLES = ("q", "k", "v", "qkv", "o")      # the attention projections (ModernBERT fuses qkv)
MLP_ROLES = ("gate", "up", "down", "gate_up")      # the MLP's (ModernBERT fuses gate_up)
CONTEXT = "attention"                               # the attention output, before its o projection
_PREFIX = "infjax_"


def name_of(role: str) -> str:
    """The checkpoint name a projection of `role` (or the attention output, CONTEXT) carries."""
    return _PREFIX + role


def tag(x: jax.Array, role: str | None) -> jax.Array:
    """`x` named for the policies (a no-op outside a rematerialised layer); untagged when `role` is None."""
    return x if role is None else checkpoint_name(x, name_of(role))


def normalize(value: Any) -> str:
    """A config's `model.remat` as a policy name: True / False (how configs and checkpoints said it before there
    were policies) are `full` / `none`; a name is returned as it is (validated by `validate`)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return "full" if value.lower() == "true" else "none"
    return value


def validate(value: Any) -> str | None:
    """None when `value` is a policy, `auto`, or a True/False alias; else why not (one line, the choices)."""
    name = normalize(value)
    if isinstance(name, str) and name in CHOICES:
        return None
    return f"unknown remat policy; choose one of {', '.join(CHOICES)} (True/False mean full/none)"


def offload_supported(platform: str | None = None) -> bool:
    """Whether saved activations can wait in pinned host memory: an accelerator with a `pinned_host` memory
    space (GPU, TPU; `platform`, default the one the program is compiled for) and a jax that has the policy."""
    if not hasattr(jax.checkpoint_policies, "save_and_offload_only_these_names"):
        return False
    return (platform or kernels.platform()) in ("gpu", "tpu")


def effective(name: Any, platform: str | None = None) -> str:
    """The policy a run computes with: `offload` where the platform cannot offload is `full` (one warning)."""
    name = normalize(name)
    platform = platform or kernels.platform()
    if name == "offload" and not offload_supported(platform):
        log.warning("model.remat=offload: this platform (%s) has no pinned host memory for saved activations; "
                    "using full (recompute each layer) instead", platform)
        return "full"
    return name


def checkpoint_policy(name: str):
    """The `jax.checkpoint` policy of a policy name (not none or auto)."""
    every = [name_of(r) for r in ATTENTION_ROLES + MLP_ROLES] + [name_of(CONTEXT)]
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots":
        return jax.checkpoint_policies.save_only_these_names(*every)
    if name == "dots_except_mlp":
        return jax.checkpoint_policies.save_only_these_names(
            *[name_of(r) for r in ATTENTION_ROLES] + [name_of(CONTEXT)])
    if name == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=every,
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"model.remat={name!r}: {validate(name) or 'not a policy to compile (auto is chosen first)'}")


def wrap(layer_cls: type[nn.Module], name: Any, scan: bool) -> type[nn.Module]:
    """`layer_cls` rematerialised under policy `name` (unchanged for none). Inside a scan, common
    subexpressions between the forward and the recompute need no protection (the loop keeps them apart)."""
    name = normalize(name)
    if name == "none":
        return layer_cls
    return nn.remat(layer_cls, policy=checkpoint_policy(name), prevent_cse=not scan)
