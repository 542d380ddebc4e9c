"""Hugging Face ModernBERT checkpoints <-> :class:`infjax.models.modernbert.ModernBertModel` parameters.

A pure name map with transposes (Linear weights; the fused ``Wqkv`` and ``Wi``
stay fused). Accepts bare ``ModernBertModel`` names and the ``model.``-prefixed
names of ``ModernBertForMaskedLM`` (answerdotai/ModernBERT-base); the MLM head
and decoder (``head.*``, ``decoder.*``) and classifier heads are ignored.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from infjax.models import hf_io
from infjax.models import layers as L
from infjax.models.modernbert import ModernBertConfig, ModernBertModel

_PREFIXES = ("model.",)
_IGNORABLE = re.compile(r"^(head|decoder|classifier)\.")


def modernbert_name_map(config: ModernBertConfig) -> Iterator[tuple[str, tuple[str, ...], bool]]:
    """Yield ``(hf_name, flax_path, transpose)`` for every tensor of HF ``ModernBertModel``."""
    yield "embeddings.tok_embeddings.weight", ("embeddings", "tok_embeddings", "embedding"), False
    yield "embeddings.norm.weight", ("embeddings", "norm", "scale"), False
    for i in range(config.num_hidden_layers):
        hf, fx = f"layers.{i}.", (f"layer_{i}",)
        if i > 0:
            yield hf + "attn_norm.weight", fx + ("attn_norm", "scale"), False
        yield hf + "attn.Wqkv.weight", fx + ("attn", "Wqkv", "kernel"), True
        yield hf + "attn.Wo.weight", fx + ("attn", "Wo", "kernel"), True
        yield hf + "mlp_norm.weight", fx + ("mlp_norm", "scale"), False
        yield hf + "mlp.Wi.weight", fx + ("mlp", "Wi", "kernel"), True
        yield hf + "mlp.Wo.weight", fx + ("mlp", "Wo", "kernel"), True
    yield "final_norm.weight", ("final_norm", "scale"), False


def modernbert_params_from_hf(tensors: Mapping[str, np.ndarray], config: ModernBertConfig) -> dict:
    """HF tensors -> unrolled Flax tree (host float32); ValueError names missing/unexpected tensors."""
    shapes = hf_io.module_param_shapes(ModernBertModel(config))
    return hf_io.params_from_hf(tensors, modernbert_name_map(config), shapes, what="ModernBERT",
                                prefixes=_PREFIXES, ignorable=_IGNORABLE)


def modernbert_params_to_hf(params: Mapping, config: ModernBertConfig, prefix: str = "") -> dict[str, np.ndarray]:
    """Flax tree (unrolled or scanned) -> HF ``ModernBertModel`` tensors (float32 numpy)."""
    return hf_io.params_to_hf(L.unstack_layers(params, 1), modernbert_name_map(config), prefix)


def load_modernbert(name_or_path: str, dtype: Any = jnp.float32, *, remat: bool = False,
                    scan_layers: bool = False, weights: bool = True) -> tuple[ModernBertModel, dict, dict, str]:
    """Resolve, read and map a ModernBERT checkpoint: ``(module, params, hf_config_dict, path)``.

    With ``scan_layers`` layers 1..N-1 come stacked under ``layers``. Without ``weights`` only
    config.json is read and ``params`` are ShapeDtypeStructs (``hf_io.abstract_params``).
    """
    path = hf_io.resolve_checkpoint(name_or_path)
    hf_config = hf_io.load_hf_config(path)
    config = ModernBertConfig.from_hf_dict(hf_config, source=os.path.join(path, "config.json"))
    module = ModernBertModel(config, dtype=dtype, remat=remat, scan_layers=scan_layers)
    if not weights:
        return module, hf_io.abstract_params(module), hf_config, path
    params = modernbert_params_from_hf(hf_io.read_safetensors(path), config)
    if scan_layers and config.num_hidden_layers > 1:
        params = L.stack_layers(params, 1, config.num_hidden_layers - 1)
    return module, params, hf_config, path
