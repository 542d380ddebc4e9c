"""Model FLOPs of a train step, counted from the model's shapes and the batch's real texts (not from XLA).

XLA's `cost_analysis()` is the wrong count for utilization: it counts the body of a `while` loop once (a
model with scanned layers looks ~L times cheaper), gives custom calls (cuDNN's attention, Pallas/Triton
kernels) no or negative FLOPs, and counts rematerialized recompute and padding as work. What is counted
here, as maxtext's and levanter's utilization figures do:

- the dense layers: 2 FLOPs per multiply-add of every dense kernel of the backbone (its parameter tree: fused
  projections, grouped kv heads, gated MLPs and scanned layers all counted as they are), per real token;
- attention: 4 FLOPs x heads x head size per (query, key) pair that a layer computes within each text (its
  own length squared; about half of it under a causal mask; a two-sided window of w: at most 2w + 1 keys),
  counted per text, so packed rows cost what their texts cost;
- training: the forward pass once and the backward pass twice over (input and weight gradients). A frozen
  weight (LoRA's base) has no weight gradient: its layers count twice, the adapters three times.

Padding, recompute (remat) and the loss's few R x R products are not model FLOPs. The interaction head of
Interaction II (one small layer per query) is left out.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

SKIP = ("embedding",)            # lookup tables: no multiply-add


def _named(tree):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        yield tuple(str(getattr(k, "key", k)) for k in path), leaf


def dense_macs(params) -> tuple[int, int]:
    """(multiply-adds per token of the dense kernels, ... of the LoRA adapters) of one tower's parameter tree
    (a layer stack scanned into one array counts every layer)."""
    dense = adapters = 0
    for path, leaf in _named(params):
        if any(s in part for part in path for s in SKIP):
            continue
        if path[-1] == "kernel":
            dense += math.prod(leaf.shape)
        elif path[-1] in ("lora_a", "lora_b"):
            adapters += math.prod(leaf.shape)
    return dense, adapters


def pairs(length: int, causal: bool = False, window: int | None = None) -> int:
    """(query, key) pairs a text of `length` tokens computes: all, those not after the query (causal), and with
    a `window`, those at most that far apart."""
    if window is None or window >= length:
        return length * (length + 1) // 2 if causal else length * length
    w = window
    if causal:                       # each query sees itself and up to w before it
        return sum(min(i, w) + 1 for i in range(length))
    return sum(min(i, w) + min(length - 1 - i, w) + 1 for i in range(length))


@dataclasses.dataclass(frozen=True)
class AttentionLayer:
    width: int                       # heads x head size of the queries
    causal: bool
    window: int | None


def attention_layers(module_config) -> list[AttentionLayer]:
    """The attention of each layer of a backbone's config (bert / modernbert / decoder configs)."""
    heads, head_dim = module_config.num_attention_heads, module_config.head_dim
    causal = hasattr(module_config, "num_key_value_heads")            # the decoders
    types = getattr(module_config, "layer_types", None) or ("full_attention",) * module_config.num_hidden_layers
    half = getattr(module_config, "local_attention", 0) // 2
    return [AttentionLayer(heads * head_dim, causal, half if kind == "sliding_attention" else None)
            for kind in types]


def text_lengths(batch: dict) -> list[int]:
    """The real token count of every text a batch encodes (padded and packed sides alike)."""
    out: list[int] = []
    for key, value in batch.items():
        if isinstance(value, dict):              # packed: each row lists its texts' lengths
            seg = np.asarray(value["segments"]).reshape(-1)
            out += [int(n) for n in seg[seg > 0]]
        elif key.endswith("_mask"):
            m = np.asarray(value)
            out += [int(n) for n in (m > 0).reshape(-1, m.shape[-1]).sum(axis=-1) if n > 0]
    return out


@dataclasses.dataclass(frozen=True)
class StepFlops:
    dense: float          # training FLOPs of the dense layers (all texts of the step)
    attention: float      # ... of attention
    tokens: int           # real tokens encoded
    texts: int

    @property
    def total(self) -> float:
        return self.dense + self.attention


def step_flops(tower_params, module_config, lengths: list[int], frozen_base: bool = False) -> StepFlops:
    """Model FLOPs of one train step that encodes texts of `lengths` tokens with a tower of `tower_params`
    (`frozen_base`: LoRA, the dense kernels do not train)."""
    dense, adapters = dense_macs(tower_params)
    tokens = int(sum(lengths))
    passes = 2 if frozen_base else 3
    dense_flops = 2.0 * tokens * (passes * dense + 3 * adapters)
    per_pair = 0.0
    lengths_arr = np.asarray(lengths, np.int64)
    for layer in attention_layers(module_config):
        if layer.window is None:
            n = lengths_arr * (lengths_arr + 1) // 2 if layer.causal else lengths_arr * lengths_arr
            count = float(n.sum())
        else:
            count = float(sum(pairs(int(n), layer.causal, layer.window) for n in lengths))
        per_pair += 4.0 * layer.width * count
    return StepFlops(dense_flops, 3.0 * per_pair, tokens, len(lengths))
