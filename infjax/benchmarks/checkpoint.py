"""Step-time stall while a checkpoint is written: `python -m infjax.bench checkpoint`.

Trains the embedded MiniLM on the synthetic corpus on the current devices,
saving every `--every` steps (asynchronously unless `--sync`), and times each
step to completion. Prints the median step time of steps without a save, of
the steps that start a save (the blocking part of `save` included), and of
the steps that run while the save is still being written.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import jax
from absl import flags

from infjax import cli, config as config_lib
from infjax.data import pipeline
from infjax.models.encoder import load_encoder
from infjax.runtime import checkpoint, mesh as mesh_lib, platform


from infjax.training import setup as setup_lib, state as state_lib


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("steps", 40, "timed steps (after 3 warm-up steps)", flag_values=fv)
    flags.DEFINE_integer("every", 8, "steps between saves", flag_values=fv)
    flags.DEFINE_bool("sync", False, "synchronous saves (otherwise asynchronous)", flag_values=fv)
    flags.DEFINE_integer("batch_size", 8, "records per global batch", flag_values=fv)


def main(argv: list[str]) -> None:
    args = cli.parse("python -m infjax.bench checkpoint", define_flags, argv, doc=__doc__.splitlines()[0])

    c = config_lib.base_config("multi_pi")
    c.train.batch_size = args.batch_size
    config_lib.validate(c, jax.device_count())
    encoder, params, path = load_encoder(c.model)
    objective = setup_lib.make_objective(c)
    data = pipeline.open_training_data(c, path, encoder.padding_side)
    batch_setup = setup_lib.make_batch_setup(c, data, encoder, path, objective)
    plan, build = batch_setup.plan, batch_setup.build
    mesh = mesh_lib.make_mesh(c.mesh)
    total = args.steps + 3
    optimizer, schedule = state_lib.make_optimizer(c.train, total)
    state, sharding = state_lib.create_sharded_state(params, optimizer, c.train.seed, encoder.module, mesh)
    step_fn = setup_lib.compiled_train_step(c, encoder, objective, optimizer, schedule, mesh, sharding)
    batches_ready = [mesh_lib.global_batch(build(s), mesh) for s in range(total)]
    config_json = {"benchmark": "checkpoint"}

    with tempfile.TemporaryDirectory() as workdir:
        ckpts = checkpoint.Checkpoints(workdir, max_to_keep=2, async_save=not args.sync)
        for s in range(3):                                   # warm-up (compile)
            state, m = step_fn(state, batches_ready[s])
        jax.block_until_ready(state)
        plain, starting, in_flight = [], [], []
        for s in range(3, total):
            t0 = time.perf_counter()
            state, m = step_fn(state, batches_ready[s])
            jax.block_until_ready(state)
            saving_before = ckpts.manager.is_saving_in_progress()
            starts = (s + 1) % args.every == 0
            if starts:
                ckpts.save(s + 1, state, plan.position(s + 1), config_json)
            dt = time.perf_counter() - t0
            (starting if starts else in_flight if saving_before else plain).append(dt)
        ckpts.close()
        size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))

    def med(xs):
        return f"{1e3 * statistics.median(xs):8.1f} ms (n={len(xs)})" if xs else "     n/a"

    print(f"MiniLM multi_pi, {build.global_rows} rows/step, state {size / 2**20:.0f} MiB, "
          f"{'synchronous' if args.sync else 'asynchronous'} saves every {args.every} steps, "
          f"{platform.describe()}")
    print(f"median step, no save in flight:      {med(plain)}")
    print(f"median step that starts a save:      {med(starting)}")
    print(f"median step while a save is written: {med(in_flight)}")


if __name__ == "__main__":
    main(sys.argv[1:])
