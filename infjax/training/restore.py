"""Load a trained model back from a run directory (any saved step), for export and evaluation."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections

from infjax.errors import UserError
from infjax.models.encoder import Encoder, load_encoder
from infjax.training import checkpoint, mesh as mesh_lib, state as state_lib


@dataclasses.dataclass
class RunModel:
    config: ml_collections.ConfigDict   # the run's resolved config, as saved in the checkpoint
    encoder: Encoder
    params: dict                        # {"shared": tree} or {"query": tree, "passage": tree}
    base_path: str                      # the HF folder the run started from (tokenizer, config.json)
    step: int


class NonFiniteParams(UserError):
    """A saved model with NaN or infinite parameters: nothing should be exported or evaluated from it."""


def first_nonfinite(tree) -> tuple[str, int, int] | None:
    """(path, non-finite count, size) of the first floating-point leaf of `tree` holding NaN or inf, else None."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        bad = int(jax.device_get(jnp.sum(~jnp.isfinite(leaf))))
        if bad:
            return jax.tree_util.keystr(path, simple=True, separator="/"), bad, int(leaf.size)
    return None


def check_finite(params, where: str) -> None:
    """Refuse parameters holding NaN or inf, naming the first bad tensor."""
    found = first_nonfinite(params)
    if found:
        name, bad, size = found
        raise NonFiniteParams(f"{where}: parameter {name} holds {bad} non-finite value(s) of {size}; the model "
                              f"is broken (train with a finite learning rate; resume from an earlier step)")


def saved_steps(workdir: str) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def load_run(workdir: str, step: int | None = None, mesh=None) -> RunModel:
    """The run's model at `step` (default: the latest) on `mesh` (default: all devices on the data axis),
    laid out by the family's partition rules (replicated when the mesh has fsdp = tensor = 1)."""
    steps = saved_steps(workdir)
    if not steps:
        raise FileNotFoundError(f"{workdir} is not an infjax run directory: no checkpoints/<step> inside")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise FileNotFoundError(f"{workdir} has no checkpoint for step {step}; saved steps: {steps}")
    ckpts = checkpoint.Checkpoints(workdir, max_to_keep=len(steps) + 1)
    try:
        config = ml_collections.ConfigDict(ckpts.saved_config(step))
        encoder, params, base_path = load_encoder(config.model)
        optimizer, _ = state_lib.make_optimizer(config.train, total_steps=1)
        mesh = mesh or mesh_lib.default_mesh()
        abstract = state_lib.abstract_state(params, optimizer)
        abstract = checkpoint.abstract_like(abstract, state_lib.state_shardings(abstract, encoder.module, mesh))
        state, _ = ckpts.restore(step, abstract)
    finally:
        ckpts.close()
    check_finite(state.params, f"{workdir} step {step}")
    return RunModel(config, encoder, state.params, base_path, step)
