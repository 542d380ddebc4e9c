"""Bi-encoder towers: backbone -> pooling -> L2 normalization, and loading from a config.

Parameters are {"shared": tree} (one theta for passages and
instruction-queries, the default) or {"query": tree, "passage": tree}.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from infjax.models import hf_io, interaction
from infjax.models.hf_decoder import load_llama, load_qwen2
from infjax.models.hf_modernbert import load_modernbert
from infjax.models.pooling import l2_normalize, pool

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def load_bert(name_or_path: str, dtype=jnp.float32, *, remat: bool = False, scan_layers: bool = False):
    """`hf_io.load_bert` with the loader options of the other families (BERT has no scanned variant)."""
    if scan_layers:
        raise ValueError("config.model.scan_layers=True is not available for the BERT family; set it to False")
    module, params, hf_config, path = hf_io.load_bert(name_or_path, dtype)
    return (module.clone(remat=True) if remat else module), params, hf_config, path


# family -> (loader(path, dtype, *, remat, scan_layers) -> (module, params, hf_config, path), padding side)
LOADERS = {
    "bert": (load_bert, "right"),
    "modernbert": (load_modernbert, "right"),
    "llama": (load_llama, "left"),
    "qwen2": (load_qwen2, "left"),
}
FAMILIES = tuple(LOADERS)
# config.json model_type -> family
MODEL_TYPES = {"bert": "bert", "modernbert": "modernbert", "llama": "llama", "qwen2": "qwen2"}


@dataclasses.dataclass(frozen=True)
class Encoder:
    """A backbone module plus its pooling; call it as a pure function of params."""

    module: object             # a flax.linen module: apply({"params": p}, ids, mask, deterministic=...)
    pooling: str               # mean | cls | last
    padding_side: str = "right"   # decoders pad on the left and pool the last token

    def hidden(self, params, ids: jax.Array, mask: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        """Float32 token states [N, L, H] of token ids [N, L]."""
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else None
        out = self.module.apply({"params": params}, ids, mask, deterministic=dropout_rng is None, rngs=rngs)
        return out.astype(jnp.float32)

    def __call__(self, params, ids: jax.Array, mask: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        """L2-normalized float32 embeddings [N, d] of token ids [N, L]."""
        return l2_normalize(pool(self.hidden(params, ids, mask, dropout_rng), mask, self.pooling))


def query_params(params: dict):
    return params["shared"] if "shared" in params else params["query"]


def passage_params(params: dict):
    return params["shared"] if "shared" in params else params["passage"]


def checkpoint_path(name: str) -> str:
    """A local folder for `model.checkpoint`: the embedded MiniLM, a folder, or a hub download."""
    from infjax.config import EMBEDDED

    if name == EMBEDDED:
        return hf_io.embedded_minilm_path()
    return hf_io.resolve_checkpoint(name)


def detect_family(path: str, requested: str = "auto") -> str:
    """The backbone family of a checkpoint folder, from its config.json `model_type`."""
    model_type = hf_io.load_hf_config(path).get("model_type", "bert")
    family = MODEL_TYPES.get(model_type)
    if family is None:
        raise ValueError(f"{path}/config.json: model_type {model_type!r} is not supported; "
                         f"supported: {sorted(MODEL_TYPES)}")
    if requested not in ("auto", family):
        raise ValueError(f"config.model.family={requested!r} but {path}/config.json has model_type {model_type!r}")
    return family


def load_encoder(model_config) -> tuple[Encoder, dict, str]:
    """(encoder, params, local checkpoint folder) for the `config.model` section."""
    path = checkpoint_path(model_config.checkpoint)
    loader, padding_side = LOADERS[detect_family(path, model_config.family)]
    module, backbone, hf_config, path = loader(path, dtype=DTYPES[model_config.dtype],
                                               remat=bool(model_config.get("remat", False)),
                                               scan_layers=bool(model_config.get("scan_layers", False)))
    params = {"shared": backbone} if model_config.shared_encoder else \
        {"query": backbone, "passage": jax.tree.map(lambda x: x.copy(), backbone)}
    if model_config.get("interaction", "concat") == "cross_attention":
        params["interaction"] = interaction.init_head(int(hf_config["hidden_size"]))
    return Encoder(module, model_config.pooling, padding_side), params, path
