"""The backbone families: everything infjax knows about one, in one record.

Adding a family is a model file (Flax module, config parsed from HF's
config.json, HF name map for import and export) plus one `Family` entry
here. Everything else (encoder loading, partition rules, export, default
pooling, padding side, config validation) reads this table.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from jax.sharding import PartitionSpec as P

from infjax.models import hf_io
from infjax.models.bert import BertConfig, BertModel
from infjax.models.decoder import DecoderConfig, DecoderModel
from infjax.models.hf_decoder import decoder_params_to_hf, load_decoder
from infjax.models.hf_modernbert import load_modernbert, modernbert_params_to_hf
from infjax.models.modernbert import ModernBertConfig, ModernBertModel

# Partition specs name the mesh axes (training/mesh.py): kernels are [in, out].
IN_OUT = P("fsdp", "tensor")       # x @ W: the output features split over tensor
OUT_IN = P("tensor", "fsdp")       # the projection back to the residual stream
EMBED = P("tensor", "fsdp")        # [vocab, hidden]
REPLICATED = P()


@dataclasses.dataclass(frozen=True)
class Family:
    """One backbone family."""

    name: str
    model_types: tuple[str, ...]       # config.json `model_type` values this family reads
    module: type                       # its Flax module class
    # (path, dtype, *, remat, scan_layers) -> (flax module, params, hf config dict, local path)
    load: Callable[..., tuple[Any, dict, dict, str]]
    # (params, hf config dict, source for messages) -> {HF tensor name: float32 array} of the bare model
    to_hf: Callable[[Any, dict, str], dict]
    architecture: str                  # the bare model's HF class, written to an export's config.json
    padding_side: str                  # right (encoders) | left (decoders: the last token is the text's last)
    default_pooling: str               # what model.pooling=auto and an HF folder without a choice use
    # ordered (regex over "a/b/kernel" paths, spec of the trailing dims): the first match shards a parameter
    partition_rules: tuple[tuple[str, P], ...]


def _bert_to_hf(params, hf_config, source):
    return hf_io.bert_params_to_hf(params, BertConfig.from_hf_dict(hf_config, source))


def _modernbert_to_hf(params, hf_config, source):
    return modernbert_params_to_hf(params, ModernBertConfig.from_hf_dict(hf_config, source))


def _decoder_to_hf(params, hf_config, source):
    return decoder_params_to_hf(params, DecoderConfig.from_hf_dict(hf_config, source))


BERT_RULES = (
    (r"embeddings/(word|position|token_type)_embeddings/embedding$", EMBED),
    (r"attention/(query|key|value)/kernel$", IN_OUT),
    (r"attention/(query|key|value)/bias$", P("tensor")),
    (r"attention/output/kernel$", OUT_IN),
    (r"intermediate/kernel$", IN_OUT),
    (r"intermediate/bias$", P("tensor")),
    (r"output/kernel$", OUT_IN),
    (r"(LayerNorm|_norm|norm)/(scale|bias)$", REPLICATED),
    (r"/bias$", REPLICATED),
)
MODERNBERT_RULES = (
    (r"tok_embeddings/embedding$", EMBED),
    (r"attn/Wqkv/kernel$", IN_OUT),
    (r"attn/Wo/kernel$", OUT_IN),
    (r"mlp/Wi/kernel$", IN_OUT),
    (r"mlp/Wo/kernel$", OUT_IN),
    (r"norm/(scale|bias)$", REPLICATED),
)
DECODER_RULES = (
    (r"embed_tokens/embedding$", EMBED),
    (r"self_attn/(q|k|v)_proj/kernel$", IN_OUT),
    (r"self_attn/(q|k|v)_proj/bias$", P("tensor")),
    (r"self_attn/o_proj/kernel$", OUT_IN),
    (r"mlp/(gate|up)_proj/kernel$", IN_OUT),
    (r"mlp/down_proj/kernel$", OUT_IN),
    (r"norm/scale$", REPLICATED),
)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("bert", ("bert",), BertModel, hf_io.load_bert, _bert_to_hf, "BertModel", "right", "mean", BERT_RULES),
    Family("modernbert", ("modernbert",), ModernBertModel, load_modernbert, _modernbert_to_hf, "ModernBertModel", "right", "mean",
           MODERNBERT_RULES),
    Family("llama", ("llama",), DecoderModel, functools.partial(load_decoder, model_type="llama"), _decoder_to_hf,
           "LlamaModel", "left", "last", DECODER_RULES),
    Family("qwen2", ("qwen2",), DecoderModel, functools.partial(load_decoder, model_type="qwen2"), _decoder_to_hf,
           "Qwen2Model", "left", "last", DECODER_RULES),
)}


def of_module(module) -> Family:
    """The (first) family whose Flax module class `module` is an instance of."""
    for family in FAMILIES.values():
        if isinstance(module, family.module):
            return family
    raise ValueError(f"{type(module).__name__} is not the module of any family in infjax/models/registry.py")


def by_model_type(model_type: str, source: str = "config.json") -> Family:
    """The family that reads checkpoints of `model_type`; ValueError names the supported ones."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    supported = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"{source}: model_type {model_type!r} is not supported; supported: {supported}")
