"""Interaction II: instruction-query cross-attention (paper Eq. 4, docs/method.md §2.3.2).

    iq(j, k) = softmax( (i_j W_i) (H_k W_q1)^T / sqrt(d) ) (H_k W_q2)

i_j = g(I_j) is the instruction's pooled embedding and H_k the token states
of the query Q_k encoded alone. Eq. 4 is written for pooled vectors, where a
softmax over a single key is identically 1; we read it, as docs/method.md §2.3.2 says,
with the query's tokens as keys and values (padding masked) and the pooled
instruction as the attention query. The result is L2-normalized like every
other embedding.

Because instructions and queries are encoded once each, every (instruction
j, query k) pair of the batch costs only this head, so the I-marginal uses
all R x R pairs. `pair_cosines` computes cos(iq(j, k), p_k) for all pairs
without materializing the R x R x d vectors: with V_k = H_k W_q2 and
attention weights a_jk over tokens,
    <iq(j,k), p_k> = a_jk . (V_k p_k)      |iq(j,k)|^2 = a_jk^T (V_k V_k^T) a_jk.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def init_head(dim: int) -> dict:
    """W_i, W_q1, W_q2 as identities: at start iq is an instruction-weighted mean of the query's tokens."""
    eye = np.eye(dim, dtype=np.float32)
    return {"w_i": eye.copy(), "w_q1": eye.copy(), "w_q2": eye.copy()}


def abstract_head(dim: int) -> dict:
    """The head's shapes and dtypes (nothing allocated), for restoring it from a checkpoint."""
    return {name: jax.ShapeDtypeStruct((dim, dim), np.float32) for name in ("w_i", "w_q1", "w_q2")}


def _attention(head: dict, i_vec: jax.Array, q_hidden: jax.Array, q_mask: jax.Array, pairs: str) -> jax.Array:
    """Attention weights over query tokens: [R, L] for the diagonal pairs, [R_j, R_k, L] for all pairs."""
    d = i_vec.shape[-1]
    a = (i_vec @ head["w_i"]) / jnp.sqrt(jnp.float32(d))           # [R, d]
    keys = jnp.einsum("kld,de->kle", q_hidden, head["w_q1"])         # [R, L, d]
    if pairs == "diagonal":
        logits = jnp.einsum("rd,rld->rl", a, keys)
        mask = q_mask.astype(bool)
    else:
        logits = jnp.einsum("jd,kld->jkl", a, keys)
        mask = q_mask.astype(bool)[None, :, :]
    return jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)


def iq_embeddings(head: dict, i_vec: jax.Array, q_hidden: jax.Array, q_mask: jax.Array) -> jax.Array:
    """iq(r, r) for each row, L2-normalized: [R, d]."""
    weights = _attention(head, i_vec, q_hidden, q_mask, "diagonal")
    values = jnp.einsum("rld,de->rle", q_hidden, head["w_q2"])
    iq = jnp.einsum("rl,rld->rd", weights, values)
    return iq / jnp.maximum(jnp.linalg.norm(iq, axis=-1, keepdims=True), 1e-12)


def pair_cosines(head: dict, i_vec: jax.Array, q_hidden: jax.Array, q_mask: jax.Array, p: jax.Array,
                 dim: int | None = None) -> jax.Array:
    """cos(iq(j -> k), p_k) for every row k (query and passage) and instruction j: [R_k, R_j].

    `dim`: of the first `dim` coordinates of both embeddings (Matryoshka), None for the whole."""
    weights = _attention(head, i_vec, q_hidden, q_mask, "all")        # [R_j, R_k, L]
    values = jnp.einsum("kld,de->kle", q_hidden, head["w_q2"])        # [R_k, L, d]
    if dim is not None and dim < values.shape[-1]:
        values, p = values[..., :dim], p[..., :dim]
        p = p / jnp.maximum(jnp.linalg.norm(p, axis=-1, keepdims=True), 1e-12)
    vp = jnp.einsum("kld,kd->kl", values, p)                          # [R_k, L]
    gram = jnp.einsum("kld,kmd->klm", values, values)                 # [R_k, L, L]
    dot = jnp.einsum("jkl,kl->jk", weights, vp)
    norm2 = jnp.einsum("jkl,klm,jkm->jk", weights, gram, weights)
    return (dot / jnp.sqrt(jnp.maximum(norm2, 1e-24))).T
