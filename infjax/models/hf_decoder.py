"""Hugging Face Llama / Qwen2 checkpoints <-> :class:`infjax.models.decoder.DecoderModel` parameters.

A pure name map with transposes (Linear weights); RoPE needs no permutation
because the module uses HF's rotate-half layout. Accepts bare-model names
(``LlamaModel``: ``embed_tokens.weight``) and ``*ForCausalLM`` names
(``model.embed_tokens.weight``); the LM head (``lm_head.weight``, tied or not)
is not part of an encoder and is ignored, as are stale rotary buffers.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterator, Mapping

import jax.numpy as jnp
import numpy as np

from infjax.models import hf_io
from infjax.models import layers as L
from infjax.models.decoder import DecoderConfig, DecoderModel

_PREFIXES = ("model.",)
_IGNORABLE = re.compile(r"^lm_head\.weight$|(^|\.)rotary_emb\.inv_freq$")


def decoder_name_map(config: DecoderConfig) -> Iterator[tuple[str, tuple[str, ...], bool]]:
    """Yield ``(hf_name, flax_path, transpose)`` for every tensor of the bare HF model."""
    yield "embed_tokens.weight", ("embed_tokens", "embedding"), False
    for i in range(config.num_hidden_layers):
        hf, fx = f"layers.{i}.", (f"layer_{i}",)
        yield hf + "input_layernorm.weight", fx + ("input_layernorm", "scale"), False
        for proj in ("q_proj", "k_proj", "v_proj"):
            yield hf + f"self_attn.{proj}.weight", fx + ("self_attn", proj, "kernel"), True
            if config.qkv_bias:
                yield hf + f"self_attn.{proj}.bias", fx + ("self_attn", proj, "bias"), False
        yield hf + "self_attn.o_proj.weight", fx + ("self_attn", "o_proj", "kernel"), True
        yield hf + "post_attention_layernorm.weight", fx + ("post_attention_layernorm", "scale"), False
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield hf + f"mlp.{proj}.weight", fx + ("mlp", proj, "kernel"), True
    yield "norm.weight", ("norm", "scale"), False


def decoder_params_from_hf(tensors: Mapping[str, np.ndarray], config: DecoderConfig) -> dict:
    """HF tensors -> unrolled Flax tree (host float32); ValueError names missing/unexpected tensors."""
    shapes = hf_io.module_param_shapes(DecoderModel(config))
    return hf_io.params_from_hf(tensors, decoder_name_map(config), shapes, what=config.model_type,
                                prefixes=_PREFIXES, ignorable=_IGNORABLE)


def decoder_params_to_hf(params: Mapping, config: DecoderConfig, prefix: str = "") -> dict[str, np.ndarray]:
    """Flax tree (unrolled or scanned) -> HF bare-model tensors (float32 numpy), names prefixed by ``prefix``."""
    return hf_io.params_to_hf(L.unstack_layers(params, 0), decoder_name_map(config), prefix)


def load_decoder(name_or_path: str, dtype: Any = jnp.float32, *, remat: bool = False, scan_layers: bool = False,
                 model_type: str | None = None, weights: bool = True) -> tuple[DecoderModel, dict, dict, str]:
    """Resolve, read and map a Llama / Qwen2 checkpoint: ``(module, params, hf_config_dict, path)``.

    ``model_type`` ("llama" / "qwen2") refuses a checkpoint of the other
    family. With ``scan_layers`` the parameters come stacked under ``layers``.
    Without ``weights`` only config.json is read and ``params`` are
    ShapeDtypeStructs (``hf_io.abstract_params``).
    """
    path = hf_io.resolve_checkpoint(name_or_path)
    hf_config = hf_io.load_hf_config(path)
    source = os.path.join(path, "config.json")
    if model_type is not None and hf_config.get("model_type") != model_type:
        raise ValueError(f"{source}: model_type={hf_config.get('model_type')!r}, expected {model_type!r}")
    config = DecoderConfig.from_hf_dict(hf_config, source=source)
    module = DecoderModel(config, dtype=dtype, remat=remat, scan_layers=scan_layers)
    if not weights:
        return module, hf_io.abstract_params(module), hf_config, path
    params = decoder_params_from_hf(hf_io.read_safetensors(path), config)
    if scan_layers:
        params = L.stack_layers(params, 0, config.num_hidden_layers)
    return module, params, hf_config, path


def load_llama(name_or_path: str, dtype: Any = jnp.float32, **options) -> tuple[DecoderModel, dict, dict, str]:
    """A Llama (3.2) checkpoint; see :func:`load_decoder`."""
    return load_decoder(name_or_path, dtype, model_type="llama", **options)


def load_qwen2(name_or_path: str, dtype: Any = jnp.float32, **options) -> tuple[DecoderModel, dict, dict, str]:
    """A Qwen2 (2.5) checkpoint; see :func:`load_decoder`."""
    return load_decoder(name_or_path, dtype, model_type="qwen2", **options)


def llama_params_to_hf(params: Mapping, config: DecoderConfig, prefix: str = "") -> dict[str, np.ndarray]:
    """Llama Flax tree -> HF ``LlamaModel`` tensors."""
    return decoder_params_to_hf(params, config, prefix)


def qwen2_params_to_hf(params: Mapping, config: DecoderConfig, prefix: str = "") -> dict[str, np.ndarray]:
    """Qwen2 Flax tree -> HF ``Qwen2Model`` tensors."""
    return decoder_params_to_hf(params, config, prefix)
