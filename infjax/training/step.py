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


def embed_batch(encoder: Encoder, params: dict, batch: dict, rng: jax.Array | None = None,
                need_instruction_negatives: bool = True) -> dict[str, jax.Array]:
    """The embeddings the loss needs, as keyword arguments of `losses.contrastive_loss`.

    Interaction I (concatenation): iq [R, d], p [R, d], and iq_neg [R, K, d] when
    the batch carries instruction negatives. Interaction II (cross-attention,
    the batch carries instructions and queries apart): iq [R, d], p [R, d], and
    the cosines of all R x R (instruction, query) pairs with their passages.
    """
    keys = list(jax.random.split(rng, 3)) if rng is not None else [None] * 3
    qp, pp = query_params(params), passage_params(params)
    out = {"p": encoder(pp, batch["p_ids"], batch["p_mask"], keys[1])}
    if "i_ids" in batch:
        head = params["interaction"]
        i_vec = encoder(qp, batch["i_ids"], batch["i_mask"], keys[0])
        q_hidden = encoder.hidden(qp, batch["qo_ids"], batch["qo_mask"], keys[2])
        out["iq"] = interaction.iq_embeddings(head, i_vec, q_hidden, batch["qo_mask"])
        if need_instruction_negatives:
            out["i_cos"] = interaction.pair_cosines(head, i_vec, q_hidden, batch["qo_mask"], out["p"])
            out["i_valid"] = batch["i_group"][None, :] != batch["i_group"][:, None]
        return out
    out["iq"] = encoder(qp, batch["q_ids"], batch["q_mask"], keys[0])
    if "n_ids" in batch:
        r, k, length = batch["n_ids"].shape
        flat = encoder(qp, batch["n_ids"].reshape(r * k, length), batch["n_mask"].reshape(r * k, length), keys[2])
        out["iq_neg"] = flat.reshape(r, k, -1)
    return out


def make_loss_fn(encoder: Encoder, objective: losses.Objective, dropout: bool = False):
    def loss_fn(params, batch, rng):
        embeddings = embed_batch(encoder, params, batch, rng if dropout else None,
                                 objective.needs_instruction_negatives)
        return losses.contrastive_loss(objective, **embeddings)
    return loss_fn


def make_train_step(encoder: Encoder, objective: losses.Objective, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, dropout: bool = False):
    loss_fn = make_loss_fn(encoder, objective, dropout)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, rng)
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
