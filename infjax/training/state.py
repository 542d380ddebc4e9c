"""Train state, optimizer and learning-rate schedule (SPEC §4)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import struct


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array          # root key; the step's key is fold_in(rng, step)
    skipped: jax.Array      # steps whose update was dropped for a non-finite loss or gradient


def learning_rate_schedule(peak: float, total_steps: int, warmup_steps: int = 0) -> optax.Schedule:
    """Linear warmup from 0 to `peak`, then linear decay to 0 at `total_steps`."""
    decay = optax.linear_schedule(peak, 0.0, max(total_steps - warmup_steps, 1))
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def make_optimizer(train_config, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW on the schedule, after global-norm clipping (when grad_clip > 0)."""
    schedule = learning_rate_schedule(train_config.learning_rate, total_steps, train_config.warmup_steps)
    adamw = optax.adamw(schedule, weight_decay=train_config.weight_decay)
    if train_config.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(train_config.grad_clip), adamw), schedule
    return adamw, schedule


def create_state(params: dict, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      rng=jax.random.key_data(jax.random.key(seed)), skipped=jnp.zeros((), jnp.int32))
