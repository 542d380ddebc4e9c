"""Train state, optimizer, learning-rate schedule (docs/method.md §4) and the state's shardings.

LoRA (models/lora.py): `params` are what trains (the adapters and the Interaction II head) and `frozen`
holds the base weights, which the step reads and never updates; gradients and AdamW moments exist for
`params` only. Without LoRA everything is in `params` and `frozen` is empty. Checkpoints hold the state
without `frozen` (`savable`): the base is the checkpoint the run started from.

Mixed precision: parameters (the master weights), gradients and the loss are float32;
`config.model.dtype` only sets the encoders' compute dtype. `train.moments_dtype="bfloat16"`
stores AdamW's first moment (mu) in bfloat16 (optax's `mu_dtype`); the second moment (nu) stays
float32: squared gradients span a range whose small values bfloat16's 8-bit mantissa rounds
badly, and nu sets the step size of every coordinate.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from infjax.models import lora
from infjax.runtime import partitioning
from infjax.runtime.mesh import put

MOMENTS_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


class TrainState(struct.PyTreeNode):
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array          # root key; the step's key is fold_in(rng, step)
    skipped: jax.Array      # steps whose update was dropped for a non-finite loss or gradient
    frozen: dict = struct.field(default_factory=dict)   # LoRA: {"backbone": base weights}; else {}

    @property
    def model_params(self) -> dict:
        """The model's whole tree ({"shared": ...} or {"query", "passage"}, + "interaction")."""
        return lora.combine(self.params, self.frozen)


def savable(state: TrainState) -> TrainState:
    """What a checkpoint holds: the state without the frozen base."""
    return state.replace(frozen={})


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
    mu_dtype = MOMENTS_DTYPES[train_config.get("moments_dtype", "float32")]
    adamw = optax.adamw(schedule, weight_decay=train_config.weight_decay, mu_dtype=mu_dtype)
    if train_config.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(train_config.grad_clip), adamw), schedule
    return adamw, schedule


def create_state(params: dict, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    """The state at step 0 of a model tree: with adapters in it, only they (and the head) train."""
    trainable, frozen = lora.split(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=trainable, opt_state=optimizer.init(trainable),
                      rng=jax.random.key_data(jax.random.key(seed)), skipped=jnp.zeros((), jnp.int32),
                      frozen=frozen)


def abstract_state(params, optimizer: optax.GradientTransformation, seed: int = 0) -> TrainState:
    """The state's shapes and dtypes (nothing allocated); `params` may be ShapeDtypeStructs."""
    return jax.eval_shape(lambda p: create_state(p, optimizer, seed), params)


def state_shardings(abstract: TrainState, module, mesh: Mesh) -> TrainState:
    """Parameters by the family's partition rules, optimizer moments like their parameters,
    scalars (step, counts, rng) replicated."""
    repl = NamedSharding(mesh, P())
    params = partitioning.param_shardings(abstract.params, module, mesh)
    opt = partitioning.like_params(abstract.opt_state, abstract.params, params, repl)
    return TrainState(step=repl, params=params, opt_state=opt, rng=repl, skipped=repl,
                      frozen=partitioning.param_shardings(abstract.frozen, module, mesh))


def create_sharded_state(params, optimizer: optax.GradientTransformation, seed: int, module, mesh: Mesh):
    """(state, state shardings): host parameters placed by their shardings, the rest created
    sharded by one jitted init with `out_shardings`."""
    abstract = abstract_state(params, optimizer, seed)
    shardings = state_shardings(abstract, module, mesh)
    trainable, frozen = lora.split(params)        # on the host: a base shared by two towers is placed once
    create = jax.jit(lambda t, f: create_state(lora.combine(t, f), optimizer, seed),
                     in_shardings=(shardings.params, shardings.frozen), out_shardings=shardings, donate_argnums=(0, 1))
    return create(put(trainable, shardings.params), put(frozen, shardings.frozen)), shardings
