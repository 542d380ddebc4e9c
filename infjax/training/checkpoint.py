"""Orbax checkpoints (current `args=` API): train state, data position and resolved config."""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def abstract_like(tree, sharding_tree=None):
    """ShapeDtypeStructs carrying the target shardings, for restoring onto a mesh."""
    if sharding_tree is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding_tree)


class Checkpoints:
    """WORKDIR/checkpoints/<step>/{state, data, config}."""

    def __init__(self, workdir: str, max_to_keep: int = 3):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_position: dict, config: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_position),
            config=ocp.args.JsonSave(config),
        ), force=True)

    def restore(self, step: int, abstract_state) -> tuple[object, dict]:
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
        ))
        return out["state"], out["data"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
