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

`encoder_calls` lists the encoder passes over those arrays and `assemble`
turns their outputs into `losses.contrastive_loss`'s keyword arguments;
gradient caching (gradcache.py) runs the same passes chunk by chunk.
"""
from __future__ import annotations

import jax

from infjax import losses
from infjax.models import interaction
from infjax.models.encoder import Encoder, passage_params, query_params


def encoder_calls(encoder: Encoder, batch: dict) -> dict[str, tuple]:
    """The encoder passes of a batch: name -> (fn(params, ids, mask, rng) -> out, ids [N, L], mask, key index).

    Every output has N leading rows, one per row of `ids`; `assemble` turns them into the loss's
    arguments. The key index picks the pass's dropout key (of 3 split from the step's key).
    """
    pooled = lambda select: lambda params, ids, mask, rng: encoder(select(params), ids, mask, rng)  # noqa: E731
    calls = {"p": (pooled(passage_params), batch["p_ids"], batch["p_mask"], 1)}
    if "i_ids" in batch:
        calls["i_vec"] = (pooled(query_params), batch["i_ids"], batch["i_mask"], 0)
        calls["q_hidden"] = (lambda params, ids, mask, rng: encoder.hidden(query_params(params), ids, mask, rng),
                             batch["qo_ids"], batch["qo_mask"], 2)
        return calls
    calls["iq"] = (pooled(query_params), batch["q_ids"], batch["q_mask"], 0)
    if "n_ids" in batch:
        r, k, length = batch["n_ids"].shape
        calls["iq_neg"] = (pooled(query_params), batch["n_ids"].reshape(r * k, length),
                           batch["n_mask"].reshape(r * k, length), 2)
    return calls


def assemble(params: dict, outputs: dict, batch: dict, need_instruction_negatives: bool = True) -> dict:
    """The loss's keyword arguments from the encoder outputs (and the interaction head's parameters)."""
    if "q_hidden" in outputs:
        head = params["interaction"]
        i_vec, q_hidden = outputs["i_vec"], outputs["q_hidden"]
        out = {"p": outputs["p"], "iq": interaction.iq_embeddings(head, i_vec, q_hidden, batch["qo_mask"])}
        if need_instruction_negatives:
            out["i_cos"] = interaction.pair_cosines(head, i_vec, q_hidden, batch["qo_mask"], outputs["p"])
            out["i_valid"] = batch["i_group"][None, :] != batch["i_group"][:, None]
        return out
    out = {"p": outputs["p"], "iq": outputs["iq"]}
    if "iq_neg" in outputs:
        r, k = batch["n_ids"].shape[:2]
        out["iq_neg"] = outputs["iq_neg"].reshape(r, k, -1)
    return out


def embed_batch(encoder: Encoder, params: dict, batch: dict, rng: jax.Array | None = None,
                need_instruction_negatives: bool = True) -> dict[str, jax.Array]:
    """The embeddings the loss needs, as keyword arguments of `losses.contrastive_loss`.

    Interaction I (concatenation): iq [R, d], p [R, d], and iq_neg [R, K, d] when
    the batch carries instruction negatives. Interaction II (cross-attention,
    the batch carries instructions and queries apart): iq [R, d], p [R, d], and
    the cosines of all R x R (instruction, query) pairs with their passages.
    """
    keys = list(jax.random.split(rng, 3)) if rng is not None else [None] * 3
    outputs = {name: fn(params, ids, mask, keys[key]) for name, (fn, ids, mask, key)
               in encoder_calls(encoder, batch).items()}
    return assemble(params, outputs, batch, need_instruction_negatives)


def make_loss_fn(encoder: Encoder, objective: losses.Objective, dropout: bool = False):
    def loss_fn(params, batch, rng):
        embeddings = embed_batch(encoder, params, batch, rng if dropout else None,
                                 objective.needs_instruction_negatives)
        return losses.contrastive_loss(objective, **embeddings)
    return loss_fn
