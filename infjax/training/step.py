"""The train step: one pure function (state, batch) -> (state, metrics), jitted once."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from infjax import losses
from infjax.models import interaction
from infjax.models.encoder import Encoder, passage_params, query_params
from infjax.training.mesh import batch_sharding, replicated
from infjax.training.state import TrainState


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


def make_grad_fn(encoder: Encoder, objective: losses.Objective, dropout: bool = False, chunk_size: int = 0,
                 mesh: Mesh | None = None):
    """grad_fn(params, batch, rng) -> ((loss, metrics), grads): plain autodiff, or gradient caching
    (`chunk_size` rows per encoder pass, see `gradcache`) when chunk_size > 0."""
    if chunk_size > 0:
        from infjax.training import gradcache

        return gradcache.make_grad_fn(encoder, objective, chunk_size, dropout, mesh)
    return jax.value_and_grad(make_loss_fn(encoder, objective, dropout), has_aux=True)


def make_train_step(encoder: Encoder, objective: losses.Objective, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, dropout: bool = False, chunk_size: int = 0, mesh: Mesh | None = None):
    grad_fn = make_grad_fn(encoder, objective, dropout, chunk_size, mesh)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        (loss, metrics), grads = grad_fn(state.params, batch, rng)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A non-finite loss or gradient never reaches the parameters or the optimizer moments.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, learning_rate=schedule(state.step), finite=finite)
        return state.replace(step=state.step + 1, params=keep(params, state.params),
                             opt_state=keep(opt_state, state.opt_state),
                             skipped=state.skipped + (~finite).astype(state.skipped.dtype)), metrics

    return train_step


def jit_train_step(train_step, mesh: Mesh, state_sharding):
    """Compile-once step with explicit shardings; the incoming state is donated."""
    return jax.jit(train_step, in_shardings=(state_sharding, batch_sharding(mesh)),
                   out_shardings=(state_sharding, replicated(mesh)), donate_argnums=0)
