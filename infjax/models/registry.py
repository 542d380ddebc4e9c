"""The backbone families: everything infjax knows about one, in one record.

Adding a family is a model file (Flax module, config parsed from HF's
config.json, `HF_NAMES`: its Hugging Face name map) plus one `Family` entry
here. Everything else (loading, partition rules, export, default pooling,
padding side, config validation) reads this table. What the module and its
config must offer is written down as two protocols, `Backbone` and
`BackboneConfig` (tests/models/test_registry.py checks every family).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, NamedTuple, Protocol, runtime_checkable

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from infjax.models import bert, decoder, modernbert
from infjax.models.hf import files as hf_files
from infjax.models.hf.names import NameMap, abstract_params

# Partition specs name the mesh axes (training/mesh.py): kernels are [in, out].
IN_OUT = P("fsdp", "tensor")       # x @ W: the output features split over tensor
OUT_IN = P("tensor", "fsdp")       # the projection back to the residual stream
EMBED = P("tensor", "fsdp")        # [vocab, hidden]
REPLICATED = P()


@runtime_checkable
class BackboneConfig(Protocol):
    """What infjax reads of a family's config: a dataclass parsed from Hugging Face's config.json.

    `from_hf_dict(config.json dict, source)` builds it (ValueError names `source` and the key); it has a `lora`
    field, which `dataclasses.replace(config, lora=spec)` sets to give the module adapters (models/lora.py)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int                      # what the attention kernels are chosen by (models/attention.py)
    lora: Any                          # a models.lora.LoraSpec, or None: the backbone trains whole

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "BackboneConfig": ...


@runtime_checkable
class Backbone(Protocol):
    """What infjax reads of a family's Flax module (models/encoder.py's Encoder, `Family.load`, `of_module`).

    Built as `module(config, dtype=, residual=, remat=, scan_layers=)`; `clone(**fields)` (flax) changes a field
    (remat, activation_sharding, config); `apply({"params": p}, ids, segment_ids, deterministic=, rngs=)` gives
    the token states [N, L, hidden_size]."""

    config: BackboneConfig
    dtype: Any                         # the compute dtype (models/precision.py)
    residual: str                      # the residual stream's dtype under a lower `dtype`
    remat: Any                         # what each layer keeps for the backward pass (models/remat.py)
    scan_layers: bool                  # the layers run under nn.scan, parameters stacked under `layers`
    activation_sharding: Any           # of the [B, L, H] activations between layers, or None

    def clone(self, **overrides) -> "Backbone": ...

    def apply(self, variables, *args, **kwargs): ...


class Loaded(NamedTuple):
    """A checkpoint read by `Family.load`."""

    module: Backbone                   # the family's Flax module, built for the checkpoint's config
    params: dict                       # host float32 arrays (ShapeDtypeStructs without weights)
    hf_config: dict                    # its config.json
    path: str                          # the local folder it was read from


@dataclasses.dataclass(frozen=True)
class Family:
    """One backbone family."""

    name: str
    model_types: tuple[str, ...]       # config.json `model_type` values this family reads
    config: type                       # its config class: .from_hf_dict(config.json dict, source)
    names: NameMap                     # HF tensor names <-> its parameter tree (names.module: its Flax module)
    architecture: str                  # the bare model's HF class, written to an export's config.json
    padding_side: str                  # right (encoders) | left (decoders: the last token is the text's last)
    default_pooling: str               # what model.pooling=auto and an HF folder without a choice use
    # ordered (regex over "a/b/kernel" paths, spec of the trailing dims): the first match shards a parameter
    partition_rules: tuple[tuple[str, P], ...]
    # what its Linear layers are to LoRA (models/lora.py): q, k, v, o, gate, up, down, or fused qkv / gate_up
    lora_roles: tuple[str, ...] = ()

    @property
    def module(self) -> type:
        """Its Flax module class: (config, dtype=, remat=, scan_layers=)."""
        return self.names.module

    def load(self, name_or_path: str, dtype: Any = jnp.float32, *, remat: bool = False, scan_layers: bool = False,
             weights: bool = True, lora: Any = None, residual: str = "float32") -> Loaded:
        """Resolve, read and map a checkpoint of this family: ``(module, params, hf_config_dict, path)``.

        ``module`` computes in ``dtype``, its residual stream in `residual`'s dtype (models/precision.py); ``params``
        are host float32 arrays, stacked under ``layers`` with ``scan_layers``. Without ``weights`` only config.json is
        read and ``params`` are the tree's ShapeDtypeStructs. With a ``lora`` spec (models/lora.py) the module carries
        adapters where it says; ``params`` are still the checkpoint's (the adapters are made by the caller).
        """
        path = hf_files.resolve_checkpoint(name_or_path)
        hf_config = hf_files.load_hf_config(path)
        source = os.path.join(path, "config.json")
        model_type = hf_config.get("model_type", self.model_types[0])
        if model_type not in self.model_types:
            raise ValueError(f"{source}: model_type={model_type!r}, expected {' or '.join(map(repr, self.model_types))}")
        config = self.config.from_hf_dict(hf_config, source=source)
        module = self.module(dataclasses.replace(config, lora=lora), dtype=dtype, residual=residual, remat=remat,
                             scan_layers=scan_layers)
        if not weights:
            return Loaded(module, abstract_params(self.module(config, remat=remat, scan_layers=scan_layers)),
                          hf_config, path)
        params = self.names.from_hf(hf_files.read_safetensors(path), config, scan_layers)
        return Loaded(module, params, hf_config, path)

    def to_hf(self, params, hf_config: dict, source: str = "config.json", prefix: str = "") -> dict:
        """{HF tensor name: float32 array} of the bare model, from a parameter tree (unrolled or scanned)."""
        return self.names.to_hf(params, self.config.from_hf_dict(hf_config, source), prefix)


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

DECODER_ROLES = ("q", "k", "v", "o", "gate", "up", "down")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("bert", ("bert",), bert.BertConfig, bert.HF_NAMES, "BertModel", "right", "mean", BERT_RULES,
           ("q", "k", "v", "o", "up", "down")),
    Family("modernbert", ("modernbert",), modernbert.ModernBertConfig, modernbert.HF_NAMES, "ModernBertModel",
           "right", "mean", MODERNBERT_RULES, ("qkv", "o", "gate_up", "down")),
    Family("llama", ("llama",), decoder.DecoderConfig, decoder.HF_NAMES, "LlamaModel", "left", "last",
           DECODER_RULES, DECODER_ROLES),
    Family("qwen2", ("qwen2",), decoder.DecoderConfig, decoder.HF_NAMES, "Qwen2Model", "left", "last",
           DECODER_RULES, DECODER_ROLES),
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
