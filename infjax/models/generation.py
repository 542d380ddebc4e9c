"""Text generation with the Llama / Qwen2 decoders: a batched, jitted prefill, then KV-cache decoding.

The forward pass is `decoder.DecoderModel`'s own blocks (`DecoderLayer`, applied with one layer's
parameters at a time) given a key/value cache, so that each new token costs one position:

- prompts arrive left-padded ([B, T] token ids and a 0/1 mask); each text's positions count from 0 at its
  first real token (as `transformers.generate` computes them from the attention mask), so a padded prompt
  generates what it would alone;
- the cache holds keys and values [layers, B, T + max_new, kv_heads, head_dim]; the prefill fills the first
  T slots in one pass, then every step writes one slot and attends to the real slots written so far;
- the layers run in a `lax.fori_loop` (one compiled layer) that updates the cache in place; the decoding
  loop is a `lax.while_loop` that stops when every row has produced the end token;
- greedy (argmax) or temperature sampling, with one PRNG key per row, so a row's tokens do not depend on
  which other prompts share its batch.

The language-model head is the transposed token embedding (tied, e.g. SmolLM2, Llama 3.2) or the
checkpoint's ``lm_head.weight`` (`load_lm_head`).
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from safetensors import safe_open

from infjax.models import layers as L
from infjax.models.decoder import DecoderConfig, DecoderLayer, DecoderModel
from infjax.models.encoder import detect_family
from infjax.models.hf import files as hf_files

_NEG = -1e30


class Decoder(NamedTuple):
    """What `generate` needs of a checkpoint."""

    config: DecoderConfig
    params: dict                       # the layers stacked under ``layers``
    head: jax.Array                    # the LM head [H, V]


def load(path: str) -> Decoder:
    """A Llama / Qwen2 checkpoint folder, ready for `generate`."""
    family = detect_family(path)
    if family.module is not DecoderModel:
        raise ValueError(f"{os.path.join(path, 'config.json')}: a {family.name} model cannot generate text "
                         "(Llama or Qwen2 can)")
    module, params, _, _ = family.load(path, scan_layers=True)
    return Decoder(module.config, params, load_lm_head(path, params, module.config))


def load_lm_head(path: str, params: dict, config: DecoderConfig) -> jax.Array:
    """The output projection [H, V]: ``lm_head.weight`` transposed if the checkpoint has one, else the
    token embedding transposed (tied embeddings)."""
    for name in hf_files.safetensors_files(path):
        with safe_open(name, framework="numpy") as f:
            if "lm_head.weight" in f.keys():
                return jnp.asarray(np.asarray(f.get_tensor("lm_head.weight"), np.float32).T)
    if not config.tie_word_embeddings:
        raise ValueError(f"{os.path.join(path, 'config.json')}: tie_word_embeddings is false but no safetensors "
                         "file holds lm_head.weight")
    return jnp.asarray(params["embed_tokens"]["embedding"]).T


@struct.dataclass
class KVCache:
    """Keys and values of every layer [layers, B, S, K, D], and where the new positions go.

    `DecoderAttention` calls `attend` with the new positions' queries, keys and values: they are written
    in place at (layer, start) and the queries attend to the slots that `mask` [B, t, S] allows."""

    keys: jax.Array
    values: jax.Array
    layer: jax.Array
    start: jax.Array
    mask: jax.Array

    def attend(self, q, k, v):
        b, t, n, d = q.shape
        kv_heads = k.shape[2]
        at = (self.layer, 0, self.start, 0, 0)
        keys = jax.lax.dynamic_update_slice(self.keys, k[None].astype(self.keys.dtype), at)
        values = jax.lax.dynamic_update_slice(self.values, v[None].astype(self.values.dtype), at)
        k_cache = jax.lax.dynamic_index_in_dim(keys, self.layer, keepdims=False)
        v_cache = jax.lax.dynamic_index_in_dim(values, self.layer, keepdims=False)
        q = q.reshape(b, t, kv_heads, n // kv_heads, d)      # query head i uses kv head i // (n // K) (HF repeat_kv)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache, preferred_element_type=jnp.float32) / np.sqrt(d)
        scores = jnp.where(self.mask[:, None, None], scores, _NEG)
        probs = jax.nn.softmax(scores, axis=-1)
        ctx = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache.astype(jnp.float32)).reshape(b, t, n, d)
        return ctx, self.replace(keys=keys, values=values)


def _forward(cfg: DecoderConfig, params, head, ids, positions, key_valid, cache, start):
    """Logits of the last new position [B, V] and the updated cache (keys, values), for new tokens ids [B, t].

    The layers run in a `fori_loop` that carries the whole cache, so each layer's keys and values are
    written in place (a scan over the cache as input and output would copy it at every token)."""
    t = ids.shape[1]
    dtype = params["embed_tokens"]["embedding"].dtype
    x = params["embed_tokens"]["embedding"][ids]
    cos, sin = L.rope_cos_sin(positions, L.rope_inv_freq(cfg.head_dim, cfg.rope))
    q_idx = start + jnp.arange(t)
    k_idx = jnp.arange(key_valid.shape[1])
    mask = key_valid[:, None, :] & (k_idx[None, None, :] <= q_idx[None, :, None])      # [B, t, S]
    block = DecoderLayer(cfg, dtype=dtype, param_dtype=dtype)
    stacked_layers = params[L.SCANNED]

    def body(layer, carry):
        x, (keys, values) = carry
        p = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), stacked_layers)
        x, kv = block.apply({"params": p}, x, cos, sin, None, KVCache(keys, values, layer, start, mask))
        return x, (kv.keys, kv.values)

    x, cache = jax.lax.fori_loop(0, cfg.num_hidden_layers, body, (x, cache))
    norm = L.RMSNorm(cfg.rms_norm_eps, dtype=dtype, param_dtype=dtype)
    x = norm.apply({"params": params["norm"]}, x[:, -1])
    return jnp.dot(x, head, preferred_element_type=jnp.float32), cache


def _pick(logits, keys, step, temperature):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)
    return jax.vmap(lambda k, l: jax.random.categorical(k, l / temperature))(step_keys, logits).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "temperature"))
def generate(config: DecoderConfig, params: dict, head: jax.Array, ids: jax.Array, mask: jax.Array, *,
             max_new_tokens: int, temperature: float = 0.0, keys: jax.Array | None = None,
             eos_id: int = -1, pad_id: int = 0, stop_mask: jax.Array | None = None) -> jax.Array:
    """New tokens [B, max_new_tokens] for left-padded prompts ids/mask [B, T] (params as `load` gives them).

    After a row's end token (`eos_id`; -1 for none) or a token that `stop_mask` [V] (bool) marks (kept in
    the output) its remaining tokens are `pad_id`. `keys` [B, 2] (one PRNG key per row) is needed when `temperature` > 0.
    """
    b, t = ids.shape
    s = t + max_new_tokens
    dtype = params["embed_tokens"]["embedding"].dtype
    shape = (config.num_hidden_layers, b, s, config.num_key_value_heads, config.head_dim)
    cache = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    mask = mask.astype(bool)
    key_valid = jnp.concatenate([mask, jnp.ones((b, max_new_tokens), bool)], axis=1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits, cache = _forward(config, params, head, ids, positions, key_valid, cache, 0)
    if keys is None:
        keys = jnp.zeros((b, 2), jnp.uint32)
    if stop_mask is None:
        stop_mask = jnp.zeros((head.shape[1],), bool)
    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32)
    state = (0, logits, cache, mask.sum(axis=1).astype(jnp.int32), out, jnp.zeros((b,), bool))

    def cond(state):
        i, *_, done = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def step(state):
        i, logits, cache, pos, out, done = state
        token = jnp.where(done, pad_id, _pick(logits, keys, i, temperature))
        out = out.at[:, i].set(token)
        done = done | (token == eos_id) | stop_mask[token]
        logits, cache = _forward(config, params, head, token[:, None], pos[:, None], key_valid, cache, t + i)
        return i + 1, logits, cache, pos + 1, out, done

    return jax.lax.while_loop(cond, step, state)[4]


def left_pad(sequences: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> left-padded ids and mask [len(sequences), length] (int32)."""
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for r, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"prompt {r} has {len(seq)} tokens, more than the padded length {length}")
        if seq:
            ids[r, length - len(seq):] = seq
            mask[r, length - len(seq):] = 1
    return ids, mask
