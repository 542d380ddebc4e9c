"""A batch -> the loss's inputs: the encoder passes of a batch and how their outputs become embeddings.

The batch (data/batches.py, this process's slice of the global batch; R rows,
one per (instruction-aware query, passage) pair) is a dict of int32 arrays:

    p_ids, p_mask     [R, Lp]     passages (P+ or a hard negative), passage prefix applied
    Interaction I (model.interaction=concat):
      q_ids, q_mask   [R, Lq]     the instruction-aware query text, template(I, Q)
      n_ids, n_mask   [R, K, Lq]  the same query under K other instructions (I-marginal; when the
                                  objective needs instruction negatives)
    Interaction II (model.interaction=cross_attention):
      i_ids, i_mask   [R, Lq]     the instruction alone
      qo_ids, qo_mask [R, Lq]     the query alone
      i_group         [R]         the record a row comes from (rows of one record share instructions)

Packed (data.packing, the default): each side is instead a dict of packed arrays
under its name ("p", "q", "n", "i", "qo"; data/packing.py), and the encoder
returns the same outputs in the same row order, so everything after the
encoder is unchanged. Under gradient caching each side's chunks are packed
apart (arrays [S, C, ...]); gradcache.py encodes one chunk at a time.

`encoder_calls` lists the encoder passes over those arrays and `assemble`
turns their outputs into `losses.contrastive_loss`'s keyword arguments;
gradient caching (gradcache.py) runs the same passes chunk by chunk.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from infjax import losses
from infjax.models import interaction
from infjax.models.encoder import Encoder, passage_params, query_params


def encoder_calls(encoder: Encoder, batch: dict) -> dict[str, tuple]:
    """The encoder passes of a batch: name -> (fn(params, ids, mask, rng) -> out, ids [N, L], mask, key index).

    Every output has N leading rows, one per text; `assemble` turns them into the loss's
    arguments. The key index picks the pass's dropout key (of 3 split from the step's key).
    A packed side passes its dict of packed arrays as `ids` and None as `mask`.
    """
    if "p" in batch:
        return _packed_calls(encoder, batch)
    pooled = lambda select: lambda params, ids, mask, rng: encoder(select(params), ids, mask, rng)  # noqa: E731
    calls = {"p": (pooled(passage_params), batch["p_ids"], batch["p_mask"], 1)}
    if "i_ids" in batch:
        calls["i_vec"] = (pooled(query_params), batch["i_ids"], batch["i_mask"], 0)
        calls["q_hidden"] = (lambda params, ids, mask, rng: encoder.hidden(
            query_params(params), ids, mask, rng, max_segments=1), batch["qo_ids"], batch["qo_mask"], 2)
        return calls
    calls["iq"] = (pooled(query_params), batch["q_ids"], batch["q_mask"], 0)
    if "n_ids" in batch:
        r, k, length = batch["n_ids"].shape
        calls["iq_neg"] = (pooled(query_params), batch["n_ids"].reshape(r * k, length),
                           batch["n_mask"].reshape(r * k, length), 2)
    return calls


def _packed_calls(encoder: Encoder, batch: dict) -> dict[str, tuple]:
    pooled = lambda select: lambda params, packed, _, rng: encoder.packed(select(params), packed, rng)  # noqa: E731
    calls = {"p": (pooled(passage_params), batch["p"], None, 1)}
    if "i" in batch:
        calls["i_vec"] = (pooled(query_params), batch["i"], None, 0)
        calls["q_hidden"] = (lambda params, packed, _, rng: unpack(
            encoder.packed_hidden(query_params(params), packed, rng), packed, packed["ids"].shape[2])[0],
            batch["qo"], None, 2)
        return calls
    calls["iq"] = (pooled(query_params), batch["q"], None, 0)
    if "n" in batch:
        calls["iq_neg"] = (pooled(query_params), batch["n"], None, 2)
    return calls


def unpack(hidden: jax.Array, packed: dict, length: int) -> tuple[jax.Array, jax.Array]:
    """Packed token states [S, T, H] -> per-text states [S * n, length, H] and their mask [S * n, length]."""
    first, last = packed["first"], packed["last"]
    offsets = jnp.arange(length)
    index = first[:, :, None] + offsets                                     # [S, n, length]
    mask = (index <= last[:, :, None]).astype(jnp.int32)
    index = jnp.minimum(index, hidden.shape[1] - 1)
    s, n = first.shape
    states = jnp.take_along_axis(hidden, index.reshape(s, n * length)[:, :, None], axis=1)
    return states.reshape(s * n, length, -1), mask.reshape(s * n, length)


def _query_mask(batch: dict) -> jax.Array:
    """The query-alone token mask [R, Lq] of Interaction II (packed: rebuilt from first/last)."""
    if "qo" not in batch:
        return batch["qo_mask"]
    first, last = batch["qo"]["first"], batch["qo"]["last"]
    if first.ndim == 3:             # chunks packed apart [S, C, n / C]: shard s's text j*C + c is at [s, c, j]
        first, last = (x.swapaxes(1, 2).reshape(x.shape[0], -1) for x in (first, last))
    length = batch["qo"]["ids"].shape[-1]
    return (jnp.arange(length) <= (last - first)[:, :, None]).astype(jnp.int32).reshape(-1, length)


def assemble(params: dict, outputs: dict, batch: dict, objective: losses.Objective) -> dict:
    """The loss's keyword arguments from the encoder outputs (and the interaction head's parameters)."""
    if "q_hidden" in outputs:
        head = params["interaction"]
        i_vec, q_hidden = outputs["i_vec"], outputs["q_hidden"]
        q_mask = _query_mask(batch)
        out = {"p": outputs["p"], "iq": interaction.iq_embeddings(head, i_vec, q_hidden, q_mask)}
        if objective.needs_instruction_negatives:
            cosines = lambda dim: interaction.pair_cosines(head, i_vec, q_hidden, q_mask,  # noqa: E731
                                                           outputs["p"], dim)
            out["i_cos"] = jnp.stack([cosines(d) for d in objective.dims]) if objective.dims else cosines(None)
            out["i_valid"] = batch["i_group"][None, :] != batch["i_group"][:, None]
    else:
        out = {"p": outputs["p"], "iq": outputs["iq"]}
        if "iq_neg" in outputs:
            r = outputs["iq"].shape[0]
            out["iq_neg"] = outputs["iq_neg"].reshape(r, outputs["iq_neg"].shape[0] // r, -1)
    if objective.mask_duplicates and "p_text" in batch:
        out["same"] = ((batch["p_text"][:, None] == batch["p_text"][None, :])
                       | (batch["iq_text"][:, None] == batch["iq_text"][None, :]))
        if "n_same" in batch and "iq_neg" in out:
            out["n_same"] = batch["n_same"].astype(bool)
    return out


def embed_batch(encoder: Encoder, params: dict, batch: dict, objective: losses.Objective,
                rng: jax.Array | None = None) -> dict[str, jax.Array]:
    """The embeddings the loss needs, as keyword arguments of `losses.contrastive_loss`.

    Interaction I (concatenation): iq [R, d], p [R, d], and iq_neg [R, K, d] when
    the batch carries instruction negatives. Interaction II (cross-attention,
    the batch carries instructions and queries apart): iq [R, d], p [R, d], and
    the cosines of all R x R (instruction, query) pairs with their passages.
    """
    keys = list(jax.random.split(rng, 3)) if rng is not None else [None] * 3
    outputs = {name: fn(params, ids, mask, keys[key]) for name, (fn, ids, mask, key)
               in encoder_calls(encoder, batch).items()}
    return assemble(params, outputs, batch, objective)


def make_loss_fn(encoder: Encoder, objective: losses.Objective, dropout: bool = False):
    def loss_fn(params, batch, rng):
        embeddings = embed_batch(encoder, params, batch, objective, rng if dropout else None)
        return losses.contrastive_loss(objective, **embeddings)
    return loss_fn
