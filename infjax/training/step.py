"""The train step: one pure function (state, batch) -> (state, metrics), jitted once."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from infjax import losses
from infjax.models import lora
from infjax.models.encoder import Encoder
from infjax.training import embed, gradcache
from infjax.runtime import cpu as runtime_cpu
from infjax.runtime.mesh import batch_sharding, replicated
from infjax.training.state import TrainState


def make_grad_fn(encoder: Encoder, objective: losses.Objective, dropout: bool = False, chunk_size: int = 0,
                 mesh: Mesh | None = None):
    """grad_fn(params, batch, rng, frozen={}) -> ((loss, metrics), grads w.r.t. params).

    Plain autodiff, or gradient caching (`chunk_size` rows per encoder pass, see `gradcache`) when chunk_size > 0.
    `frozen` (LoRA's base weights, `TrainState.frozen`) completes the model and is never differentiated."""
    if chunk_size > 0:
        return gradcache.make_grad_fn(encoder, objective, chunk_size, dropout, mesh)
    loss_fn = embed.make_loss_fn(encoder, objective, dropout)

    def grad_fn(params, batch, rng, frozen=None):
        return jax.value_and_grad(lambda p: loss_fn(lora.combine(p, frozen or {}), batch, rng), has_aux=True)(params)
    return grad_fn


def make_train_step(encoder: Encoder, objective: losses.Objective, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, dropout: bool = False, chunk_size: int = 0, mesh: Mesh | None = None):
    grad_fn = make_grad_fn(encoder, objective, dropout, chunk_size, mesh)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        (loss, metrics), grads = grad_fn(state.params, batch, rng, state.frozen)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        update_norm = optax.tree.norm(updates)
        # A non-finite loss, gradient or update (e.g. a learning rate past float32's range) never reaches the
        # parameters or the optimizer moments. Read from the norms the metrics need anyway: a norm is finite only
        # if every value it sums is (one whose square overflows float32 counts as non-finite too). Reading the
        # new parameters instead cost a reduction per leaf after the update, and a select that could not fuse
        # into it.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        params = keep(optax.apply_updates(state.params, updates), state.params)
        param_norm = optax.tree.norm(params)
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, update_norm=update_norm, param_norm=param_norm,
                       learning_rate=schedule(state.step), finite=finite)
        return state.replace(step=state.step + 1, params=params,
                             opt_state=keep(opt_state, state.opt_state),
                             skipped=state.skipped + (~finite).astype(state.skipped.dtype)), metrics

    return train_step


def jit_train_step(train_step, mesh: Mesh, state_sharding):
    """Compile-once step with explicit shardings; the incoming state is donated."""
    return jax.jit(train_step, in_shardings=(state_sharding, batch_sharding(mesh)),
                   out_shardings=(state_sharding, replicated(mesh)), donate_argnums=0,
                   compiler_options=runtime_cpu.compiler_options(mesh))
