"""Load a trained model back from a run directory (any saved step), for export and evaluation."""
from __future__ import annotations

import dataclasses
import os

import ml_collections

from infjax.models.encoder import Encoder, load_encoder
from infjax.training import checkpoint, mesh as mesh_lib, state as state_lib


@dataclasses.dataclass
class RunModel:
    config: ml_collections.ConfigDict   # the run's resolved config, as saved in the checkpoint
    encoder: Encoder
    params: dict                        # {"shared": tree} or {"query": tree, "passage": tree}
    base_path: str                      # the HF folder the run started from (tokenizer, config.json)
    step: int


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
    return RunModel(config, encoder, state.params, base_path, step)
