"""The train step: one pure function (state, batch) -> (state, metrics), jitted once."""
from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh

from infjax import losses
from infjax.models.encoder import Encoder, passage_params, query_params
from infjax.training.mesh import batch_sharding, replicated
from infjax.training.state import TrainState


def embed_batch(encoder: Encoder, params: dict, batch: dict, rng: jax.Array | None = None):
    """(iq [R, d], p [R, d], iq_neg [R, K, d] or None) for a batch of token ids."""
    keys = jax.random.split(rng, 3) if rng is not None else (None, None, None)
    iq = encoder(query_params(params), batch["q_ids"], batch["q_mask"], keys[0])
    p = encoder(passage_params(params), batch["p_ids"], batch["p_mask"], keys[1])
    iq_neg = None
    if "n_ids" in batch:
        r, k, length = batch["n_ids"].shape
        flat = encoder(query_params(params), batch["n_ids"].reshape(r * k, length),
                       batch["n_mask"].reshape(r * k, length), keys[2])
        iq_neg = flat.reshape(r, k, -1)
    return iq, p, iq_neg


def make_loss_fn(encoder: Encoder, objective: losses.Objective, dropout: bool = False):
    def loss_fn(params, batch, rng):
        iq, p, iq_neg = embed_batch(encoder, params, batch, rng if dropout else None)
        return losses.contrastive_loss(objective, iq, p, iq_neg)
    return loss_fn


def make_train_step(encoder: Encoder, objective: losses.Objective, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, dropout: bool = False):
    loss_fn = make_loss_fn(encoder, objective, dropout)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, rng)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def jit_train_step(train_step, mesh: Mesh, state_sharding):
    """Compile-once step with explicit shardings; the incoming state is donated."""
    return jax.jit(train_step, in_shardings=(state_sharding, batch_sharding(mesh)),
                   out_shardings=(state_sharding, replicated(mesh)), donate_argnums=0)
