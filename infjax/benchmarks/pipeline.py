"""The data pipeline alone: host cost per step per device, and the wait behind a stand-in device step.

    python -m infjax.bench pipeline --config=configs/multi_pi.py --paper --devices_per_process=1,4,8
    python -m infjax.bench pipeline --config=configs/multi_pi.py --paper --records=1000000 --device_step_ms=35
    python -m infjax.bench pipeline --make_data=3000000 --out=/data/inf-ir-shaped     # hub-layout parquet

For each number of devices per process D, the run's batch builder is made as
`infjax.train` makes it for D devices (packing shards, measured shapes), on the
config's data or on --records InF-IR-shaped records (written once as parquet
and read through the token cache, as a run reads a file). Then:

- cost: each of --steps steps built in this process, one after another; the
  median per step, divided by D (the CPU a step costs per device);
- wait: the same steps through the run's pipeline (data/prefetch.py: its
  workers chosen as a run chooses them, or --workers), each followed by a
  stand-in device step of --device_step_ms (a sleep: the host is free while
  the device computes, as with JAX's asynchronous dispatch); the median time a
  step waited for its batch, and the share of the loop's time spent waiting.

--paper sets the paper's shape: 32 records per device with hard negatives, 256/512
tokens, K=5 instruction negatives (a --config.KEY=VALUE of these keys wins). The
stand-in leaves out the copy of the batch to the devices (`mesh.global_batch`).
Runs on any machine; no device is used.
"""
from __future__ import annotations

import os
import tempfile
import time

import ml_collections
import numpy as np
from absl import flags

from infjax import cli, config as config_lib
from infjax.benchmarks import shapes as bench_shapes
from infjax.data import pipeline, prefetch, token_store
from infjax.models.encoder import load_encoder
from infjax.training import setup as setup_lib

PAPER = {"data.query_max_len": 256, "data.passage_max_len": 512, "loss.instruction_negatives": 5,
         "data.hard_negatives": True}
RECORDS_PER_DEVICE = 32


def define_flags(fv: flags.FlagValues) -> None:
    cli.define_config(fv, "Config file, e.g. configs/multi_pi.py[:preset]; --config.KEY=VALUE overrides a key.",
                      lock_config=False)
    flags.DEFINE_string("devices_per_process", "1,4,8", "comma-separated numbers of devices per process",
                        flag_values=fv)
    flags.DEFINE_float("device_step_ms", 35.0, "the stand-in device step (ms)", flag_values=fv)
    flags.DEFINE_integer("steps", 60, "steps timed (each way)", flag_values=fv)
    flags.DEFINE_bool("paper", False, f"the paper's shape: {RECORDS_PER_DEVICE} records per device, 256/512 tokens, "
                      f"K=5 (a --config.KEY=VALUE of these keys wins)", flag_values=fv)
    flags.DEFINE_integer("records", 0, "train on this many InF-IR-shaped records (written once as hub-layout "
                         "parquet under the token cache folder) instead of the config's data", flag_values=fv)
    flags.DEFINE_integer("workers", -2, "data.step_workers for the wait (-2: the config's)", flag_values=fv)
    flags.DEFINE_integer("make_data", 0, "only write this many InF-IR-shaped records as hub-layout parquet into "
                         "--out (data/msmarco-*.parquet), then exit", flag_values=fv)
    flags.DEFINE_string("out", "", "the folder --make_data writes", flag_values=fv)


def write_shaped(count: int, folder: str, seed: int = 0, per_file: int = 250_000) -> str:
    """`count` InF-IR-shaped records (benchmarks/shapes.py) as hub-layout parquet files in `folder`; the folder.

    The files are data/msmarco-NNNNN-of-MMMMM.parquet, written file by file: memory stays that of one file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = max(1, -(-count // per_file))
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    for i in range(files):
        n = min(per_file, count - i * per_file)
        records = bench_shapes.inf_ir_shaped_records(n, seed=seed * 100_003 + i)
        table = pa.table({k: [r[k] for r in records] for k in records[0]})
        path = os.path.join(folder, "data", f"msmarco-{i:05d}-of-{files:05d}.parquet")
        pq.write_table(table, path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"wrote {path} ({n} records)", flush=True)
    return folder


def shaped_source(count: int, cache_dir: str) -> str:
    """The folder of `count` shaped records under the token cache folder, written on first use."""
    folder = os.path.join(token_store.cache_root(cache_dir), "bench-data", f"inf-ir-shaped-{count}")
    if not os.path.isdir(os.path.join(folder, "data")):
        tmp = tempfile.mkdtemp(prefix="shaped-", dir=os.path.dirname(folder) if os.path.isdir(
            os.path.dirname(folder)) else None)
        write_shaped(count, tmp)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.replace(tmp, folder)
    return folder


def measure(config, devices: int, steps: int, step_ms: float, workers: int) -> dict:
    encoder, _, path = load_encoder(config.model, weights=False)
    t0 = time.perf_counter()
    data = pipeline.open_training_data(config, path, encoder.padding_side)
    open_s = time.perf_counter() - t0
    setup = setup_lib.make_batch_setup(config, data, encoder, path, setup_lib.make_objective(config),
                                       num_devices=devices)
    build = setup.build
    total = pipeline.total_steps(config, setup.plan)
    chosen = list(range(min(steps, total)))
    costs = []
    for step in chosen:
        t = time.perf_counter()
        build.assemble(step)
        costs.append(time.perf_counter() - t)
    n_workers, why = prefetch.choose_workers(build, workers, 0, len(chosen))
    stream = prefetch.StepStream(build, 0, len(chosen), n_workers, config.data.prefetch)
    waits = []
    with stream as batches:
        next(batches)                                   # the workers' start is not a step's wait
        t_start = time.perf_counter()
        for _ in chosen[1:]:
            t = time.perf_counter()
            next(batches)
            waits.append(time.perf_counter() - t)
            time.sleep(step_ms / 1e3)
        wall = time.perf_counter() - t_start
    return {"devices": devices, "rows": build.global_rows, "records": len(data.store), "open_s": open_s,
            "cost_ms_per_device": 1e3 * float(np.median(costs)) / devices,
            "cost_ms_per_step": 1e3 * float(np.median(costs)),
            "wait_ms": 1e3 * float(np.median(waits)), "wait_mean_ms": 1e3 * float(np.mean(waits)),
            "wait_share": float(np.sum(waits)) / wall, "pipeline": f"{stream.describe()} ({why})"}


def _load_config(fv: flags.FlagValues) -> None:
    """The --config file, loaded now (its errors are flag errors); --make_data needs none."""
    if fv["config"].present:
        cli.load_config(fv)


def main(argv: list[str]) -> None:
    fv = cli.parse("python -m infjax.bench pipeline", define_flags, argv, doc=__doc__.split("\n\n")[0],
                   after=_load_config, catch=cli.CONFIG_ERRORS, message=cli.config_flag_error)
    if fv.make_data:
        if not fv.out:
            raise config_lib.ConfigError("--make_data needs --out (the folder to write)")
        write_shaped(fv.make_data, os.path.abspath(os.path.expanduser(fv.out)))
        return
    if not fv["config"].present:
        raise config_lib.ConfigError("--config is required (e.g. --config=configs/multi_pi.py)")
    base = fv.config
    explicit = {k for k in PAPER if any(a.startswith(f"--config.{k}=") for a in argv)}
    devices_list = [int(d) for d in fv.devices_per_process.split(",") if d.strip()]
    workers = base.data.step_workers if fv.workers == -2 else fv.workers
    source = shaped_source(fv.records, base.data.cache_dir) if fv.records else None
    print(f"stand-in device step {fv.device_step_ms:g} ms; {os.cpu_count()} cores; data "
          f"{source or base.data.source}")
    print(f"{'devices':>7} {'rows':>5} {'cost/step/device':>17} {'cost/step':>10} {'wait/step':>10} "
          f"{'wait share':>10}  pipeline")
    for devices in devices_list:
        c = ml_collections.ConfigDict(base.to_dict())
        if fv.paper:
            config_lib.override(c, {k: v for k, v in PAPER.items() if k not in explicit})
            if not any(a.startswith("--config.train.batch_size=") for a in argv):
                c.train.batch_size = RECORDS_PER_DEVICE * devices
        if source:
            config_lib.override(c, {"data.source": source, "data.splits": "msmarco"})
        config_lib.validate(c, devices)
        r = measure(c, devices, fv.steps, fv.device_step_ms, workers)
        print(f"{devices:>7} {r['rows']:>5} {r['cost_ms_per_device']:>14.2f} ms {r['cost_ms_per_step']:>7.1f} ms "
              f"{r['wait_ms']:>7.2f} ms {100 * r['wait_share']:>9.1f}%  {r['pipeline']}", flush=True)
