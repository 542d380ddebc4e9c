"""Sequence pooling and normalisation for embedding models (float32 math)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

POOLING_KINDS = ("mean", "cls", "last")


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Average of the hidden states at positions where ``mask`` is 1."""
    h = hidden.astype(jnp.float32)
    m = mask.astype(jnp.float32)[..., None]
    total = jnp.sum(h * m, axis=1)
    count = jnp.maximum(jnp.sum(m, axis=1), 1e-9)
    return total / count


def cls_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Hidden state of the first real token (the [CLS] token for BERT-style inputs; position 0 when right-padded)."""
    idx = jnp.argmax(mask > 0, axis=1)
    return jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0].astype(jnp.float32)


def last_token_index(mask: jax.Array) -> jax.Array:
    """Index of the last position with ``mask == 1`` in each row.

    Works for right padding (``1 1 1 0 0`` -> 2) and left padding
    (``0 0 1 1 1`` -> 4). A row without any real token maps to ``L - 1``.
    """
    seq_len = mask.shape[1]
    reversed_real = (mask > 0)[:, ::-1]
    return seq_len - 1 - jnp.argmax(reversed_real, axis=1)


def last_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Hidden state of the last real token of each sequence."""
    idx = last_token_index(mask)
    picked = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
    return picked.astype(jnp.float32)


_POOLERS = {"mean": mean_pool, "cls": cls_pool, "last": last_pool}


def pool(hidden: jax.Array, mask: jax.Array, kind: str) -> jax.Array:
    """Pool hidden states [B, L, H] with padding mask [B, L] into [B, H] float32.

    ``kind`` is one of ``"mean"`` (masked mean), ``"cls"`` (first real token) or
    ``"last"`` (last real token, for either padding side).
    """
    try:
        pooler = _POOLERS[kind]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown pooling kind {kind!r}; allowed values: {', '.join(POOLING_KINDS)}"
        ) from None
    return pooler(hidden, mask)


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """Scale each row of ``x`` to unit L2 norm (float32), guarding tiny norms by ``eps``."""
    x = x.astype(jnp.float32)
    norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x / jnp.maximum(norm, eps)


def pool_packed(hidden: jax.Array, text: jax.Array, first: jax.Array, last: jax.Array, kind: str) -> jax.Array:
    """Pool packed hidden states [S, T, H] (T = rows x length of a shard) into [S, n, H] float32.

    ``text`` [S, T] names each token's text (n on the unused tail); ``first`` /
    ``last`` [S, n] are the flat indices of each text's first and last token
    (data.packing). Mean pooling sums each text's tokens; cls takes the first
    token and last the last, exactly as :func:`pool` does on a padded row.
    """
    n = first.shape[1]
    if kind == "mean":
        def mean(h, t):
            total = jax.ops.segment_sum(h.astype(jnp.float32), t, num_segments=n + 1)[:n]
            count = jax.ops.segment_sum(jnp.ones(t.shape, jnp.float32), t, num_segments=n + 1)[:n]
            return total / jnp.maximum(count, 1e-9)[:, None]
        return jax.vmap(mean)(hidden, text)
    if kind in ("cls", "last"):
        index = first if kind == "cls" else last
        return jnp.take_along_axis(hidden, index[:, :, None], axis=1).astype(jnp.float32)
    raise ValueError(f"unknown pooling kind {kind!r}; allowed values: {', '.join(POOLING_KINDS)}")
