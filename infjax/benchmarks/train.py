"""Train-step throughput and memory: `python -m infjax.bench train --config=configs/multi_pi.py [flags]`.

    python -m infjax.bench train --config=configs/multi_pi.py --steps=10
    python -m infjax.bench train --config=configs/multi_pi.py:llama-3.2-1b --config.mesh.fsdp=8 --steps=20
    python -m infjax.bench train --config=configs/multi_pi.py --sweep_rows=96,384,1536,3072 --sweep_chunk=96
    python -m infjax.bench train --config=configs/uni_p.py --data=inf_ir_shaped --vs_torch \
        --config.data.query_max_len=64 --config.data.passage_max_len=256 --config.train.batch_size=16

--data=inf_ir_shaped replaces the run's records by generated ones with InF-IR's
lengths (see `inf_ir_shaped_records`); --vs_torch then feeds the same rows of the
same steps to a plain PyTorch / sentence-transformers loop (in-batch softmax at
temperature 0.05, AdamW, clipping 1.0, dynamic padding to the batch's longest
text) in a child process and prints both rows/s, their ratio and both peak memories.

Throughput mode builds the run's sharded state and compiled step exactly as `infjax.train`
does, builds the batches up front (outside the timing), runs --warmup steps, then times
--steps steps and prints examples (rows)/s, tokens/s (padded and real) and model-FLOPs
utilization: the step's model FLOPs per device, counted from the model's shapes and the real texts of the
batch (benchmarks/flops.py; XLA's `cost_analysis()` is printed beside it: it counts a scanned layer once
and kernels as free), divided by the step time and the device's peak bf16 FLOP/s (table below;
--peak_flops overrides; n/a on CPU). Then the same steps run as infjax.train's loop runs them
(`real_loop`: batches from the run's pipeline, dispatched without waiting) and a line gives that
step time and the share spent waiting for data, beside the device-only step.

Sweep mode compiles (without running) the step for each global batch size in rows, with
gradient caching off and with train.chunk_size=--sweep_chunk, and prints the per-device peak
memory from `compiled.memory_analysis()` (arguments + temporaries).
"""
from __future__ import annotations

import shutil
import tempfile
import time

import jax
import ml_collections
import numpy as np
from absl import flags

from infjax import cli, config as config_lib, errors
from infjax.benchmarks import flops as flops_lib, shapes as bench_shapes, torch_loop
from infjax.benchmarks.shapes import inf_ir_shaped_records
from infjax.data import pipeline, prefetch
from infjax.data.batches import real_tokens
from infjax.models import remat as remat_lib
from infjax.models.encoder import load_encoder, query_params
from infjax.runtime import cpu as runtime_cpu, mesh as mesh_lib, platform

from infjax.training import setup as setup_lib, state as state_lib

# device_kind substring -> peak dense bf16 FLOP/s per device, the first that matches (PCIe and NVL H100s before
# the SXM part, whose kind says only "H100"; GH200 before H200)
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "GH200": 989e12, "H100": 989e12, "H200": 989e12,
              "A100": 312e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12,
              "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12}


def peak_flops(device, override: float = 0.0) -> float | None:
    if override > 0:
        return override
    for kind, flops in PEAK_FLOPS.items():
        if kind.lower() in device.device_kind.lower():
            return flops
    return None


def define_flags(fv: flags.FlagValues) -> None:
    cli.define_config(fv, "Config file, e.g. configs/multi_pi.py[:preset]; --config.KEY=VALUE overrides a key.",
                      lock_config=False)
    flags.DEFINE_integer("steps", 10, "timed steps", flag_values=fv)
    flags.DEFINE_integer("warmup", 2, "untimed steps after compilation", flag_values=fv)
    flags.DEFINE_float("peak_flops", 0.0, "peak FLOP/s per device (default: from the device table)",
                       flag_values=fv)
    flags.DEFINE_string("sweep_rows", "", "comma-separated global batch sizes in rows: print compiled peak "
                        "memory per device with and without gradient caching instead of timing", flag_values=fv)
    flags.DEFINE_integer("sweep_chunk", 96, "train.chunk_size for the gradient-caching column of the sweep",
                         flag_values=fv)
    flags.DEFINE_enum("data", "config", ["config", "inf_ir_shaped"], "training records: the config's, or "
                      "generated with InF-IR's text lengths", flag_values=fv)
    flags.DEFINE_bool("vs_torch", False, "also time a plain PyTorch loop on the same rows (MiniLM)", flag_values=fv)
    flags.DEFINE_bool("compile_only", False, "compile the step for the first batch and print its memory analysis",
                      flag_values=fv)
    flags.DEFINE_enum("shape", "", ["", *bench_shapes.SHAPES], "with --compile_only or --lora_table: the model is a "
                      "config.json of these sizes (no weights, no download) instead of config.model.checkpoint",
                      flag_values=fv)
    flags.DEFINE_bool("lora_table", False, "compile full fine-tuning and LoRA (rank --lora_rank, frozen base in "
                      "bfloat16) at the paper's 256/512 tokens, 32 records per device, bfloat16, for --lora_shapes; "
                      "print trainable parameters, optimizer-state bytes and compiled peak memory per device",
                      flag_values=fv)
    flags.DEFINE_bool("vs_full", False, "with model.lora.rank > 0: also time full fine-tuning (rank 0) on the same "
                      "rows in the same process, and print the ratio", flag_values=fv)
    flags.DEFINE_integer("lora_rank", 16, "the rank of --lora_table's LoRA rows", flag_values=fv)
    flags.DEFINE_string("lora_shapes", "qwen2.5-1.5b,qwen2.5-7b", "comma-separated --shape names for --lora_table",
                        flag_values=fv)


def _flags(argv):
    return cli.parse("python -m infjax.bench train", define_flags, argv, doc=__doc__.split("\n\n")[0],
                     required=("config",), after=cli.load_config, catch=cli.CONFIG_ERRORS,
                     message=cli.config_flag_error)


class Setup:
    """The pieces of a run that the step needs: model, data, mesh, sharded state, compiled step."""

    def __init__(self, config, records: list[dict] | None = None, weights: bool = True, devices=None,
                 choose_remat: bool = True):
        """Build the run's model, data, mesh, sharded state and compiled step from `config`.

        `weights=False` reads only the checkpoint's config.json (params are shapes): enough to compile. `devices`:
        those to build the mesh of (default: JAX's), e.g. a compile-only target's (only `compile` and `abstract_batch`
        then apply; the batches are sized by their count). With `model.remat=auto`, the policy is chosen as a run
        chooses it, unless `choose_remat` is False (the step is then `full`'s; `step_for` gives any policy's)."""
        devices = list(devices if devices is not None else jax.devices())
        config_lib.validate(config, len(devices), jax.process_count())
        self.config = config
        self.encoder, params, path = load_encoder(config.model, weights=weights)
        self.data = pipeline.open_training_data(config, path, self.encoder.padding_side, records=records)
        self.objective = setup_lib.make_objective(config)
        batch_setup = setup_lib.make_batch_setup(config, self.data, self.encoder, path, self.objective,
                                                 num_devices=len(devices))
        self.plan, self.build = batch_setup.plan, batch_setup.build
        self.mesh = mesh_lib.make_mesh(config.mesh, devices)
        self.optimizer, self.schedule = state_lib.make_optimizer(config.train, max(config.train.steps, 1000))
        self.abstract = state_lib.abstract_state(params, self.optimizer, config.train.seed)
        self.shardings = state_lib.state_shardings(self.abstract, self.encoder.module, self.mesh)
        self.params = params
        self.remat, self.remat_line = self.encoder.remat, ""
        auto = remat_lib.normalize(config.model.remat) == "auto"
        if auto and not choose_remat:
            self.step = self.step_for("full")
        else:
            example = self.abstract_inputs(self.abstract_batch(pipeline.widest_step(self.build))) if auto else None
            self.step = setup_lib.compiled_train_step(config, self.encoder, self.objective, self.optimizer,
                                                      self.schedule, self.mesh, self.shardings, example, devices[0])
            if auto:
                self.remat, self.remat_line = self.step.policy, self.step.line

    def step_for(self, policy: str):
        """The jitted train step with the layers under remat policy `policy`."""
        return setup_lib.jitted_step(self.config, self.encoder.with_remat(policy), self.objective, self.optimizer,
                                     self.schedule, self.mesh, self.shardings)

    def batch(self, i: int):
        return mesh_lib.global_batch(self.build(i), self.mesh)

    def abstract_batch(self, i: int):
        """Step `i`'s batch as ShapeDtypeStructs split over the mesh's batch axes (nothing placed: any devices)."""
        sharding = mesh_lib.batch_sharding(self.mesh)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), self.build(i))

    def abstract_inputs(self, batch):
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.abstract,
                             self.shardings)
        return state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)

    def compile(self, batch):
        """The compiled step for `batch`'s shape (the one `auto` compiled to choose, for the widest)."""
        kept = getattr(self.step, "compiled_for", lambda _: None)(batch)
        return kept if kept is not None else self.step.lower(*self.abstract_inputs(batch)).compile()


def flops_of(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


peak_bytes = setup_lib.peak_bytes


def _leaves(batch: dict):
    """(name, array) of every encoder-input array; packed sides are named like "p/ids"."""
    for path, v in jax.tree_util.tree_flatten_with_path(batch)[0]:
        yield "/".join(str(getattr(k, "key", k)) for k in path), v


def _shape(batch) -> tuple:
    return tuple((k, v.shape) for k, v in _leaves(batch))


def warm_up(compiled: dict, state, batches: list, warmup: int):
    """Run the first `warmup` batches, then one batch of each compiled shape that has not run yet; returns the state.

    A shape's first run loads the program and allocates its buffers: inside a timed loop it would be a slow step."""
    ran = set()
    for i, b in enumerate(batches):
        if i < warmup or _shape(b) not in ran:
            state, _ = compiled[_shape(b)](state, b)
            ran.add(_shape(b))
    return jax.block_until_ready(state)


def throughput(config, steps: int, warmup: int, peak_override: float = 0.0, records=None) -> dict:
    """Times `steps` steps after `warmup`; with several packed shapes (data.pack_shapes), each shape's step is
    compiled ahead of time first, and the FLOPs, buffer tokens and peak memory are those of each step's shape."""
    setup = Setup(config, records)
    state, _ = state_lib.create_sharded_state(setup.params, setup.optimizer, config.train.seed,
                                              setup.encoder.module, setup.mesh)
    batches = [setup.batch(i) for i in range(warmup + steps)]
    t0 = time.perf_counter()
    compiled = {}
    for b in batches:
        if _shape(b) not in compiled:
            compiled[_shape(b)] = setup.compile(b)
    compile_s = time.perf_counter() - t0
    state = warm_up(compiled, state, batches, warmup)
    times = []
    for b in batches[warmup:]:
        step = compiled[_shape(b)]
        t0 = time.perf_counter()
        state, metrics = step(state, b)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    rows = setup.build.global_rows
    loop = real_loop(setup, compiled, state, warmup, steps)
    timed = batches[warmup:]
    model = setup.encoder
    flops = float(np.mean([flops_lib.step_flops(query_params(setup.params), model.module.config,
                                                flops_lib.text_lengths(jax.device_get(b)),
                                                frozen_base=model.lora is not None).total
                           for b in timed])) / jax.device_count()
    compiled_flops = float(np.mean([flops_of(compiled[_shape(b)]) for b in timed]))
    padded = float(np.mean([sum(int(np.prod(v.shape)) for k, v in _leaves(b) if k.endswith("ids")) for b in timed]))
    real = float(np.mean([real_tokens(jax.device_get(b)) for b in timed]))
    peak = peak_flops(jax.devices()[0], peak_override)
    return {"device": f"{jax.device_count()} x {jax.devices()[0].device_kind}", "mesh": dict(setup.mesh.shape),
            "rows_per_step": rows, "compile_s": compile_s, "step_s": seconds, "examples_per_s": rows / seconds,
            "tokens_per_s_padded": padded / seconds, "tokens_per_s_real": real / seconds,
            "flops_per_step_per_device": flops, "compiled_flops_per_step_per_device": compiled_flops,
            "shapes": len(compiled),
            "mfu": (flops / seconds / peak) if peak and flops else None,
            "peak_memory_per_device_bytes": max(peak_bytes(c) for c in compiled.values()),
            "real_share": real / padded, "tokens_per_step": padded, "real_tokens_per_step": real,
            "step_times": times, "loop": loop, "setup": setup}


def real_loop(setup: Setup, compiled: dict, state, start: int, steps: int) -> dict:
    """Steps start+1 .. start+steps-1 as infjax.train's loop runs them, timed; returns what the loop measured.

    Each batch is assembled by the run's pipeline (data/prefetch.py, its workers chosen as a run chooses them), put on
    the devices and dispatched without waiting, the last one waited for. Returns {"step_s": wall time per step,
    "examples_per_s", "data_wait_share": the time spent waiting for batches, "pipeline": what assembled them}. The
    first batch (the workers' start) is taken before the clock."""
    c = setup.config
    workers, why = prefetch.choose_workers(setup.build, c.data.step_workers, start, start + steps)
    stream = prefetch.StepStream(setup.build, start, start + steps, workers, c.data.prefetch)
    with stream as batches:
        _, host, _ = next(batches)
        jax.block_until_ready(state)
        waited, t0 = stream.waited, time.perf_counter()
        metrics = None
        for _ in range(steps - 1):
            _, host, _ = next(batches)
            b = mesh_lib.global_batch(host, setup.mesh)
            state, metrics = compiled[_shape(b)](state, b)
        jax.block_until_ready((state, metrics))
        seconds = (time.perf_counter() - t0) / max(steps - 1, 1)
        waited = stream.waited - waited
    return {"step_s": seconds, "examples_per_s": setup.build.global_rows / seconds,
            "data_wait_share": waited / max(seconds * (steps - 1), 1e-9), "pipeline": f"{stream.describe()} ({why})"}


def sweep(config, rows_list: list[int], chunk: int) -> list[dict]:
    out = []
    for rows in rows_list:
        per_record = 3 if config.data.hard_negatives else 1
        entry = {"rows": rows}
        for label, chunk_size in (("plain", 0), ("gradcache", chunk)):
            c = config_lib.override(ml_collections.ConfigDict(config.to_dict()),
                                    {"train.batch_size": rows // per_record, "train.chunk_size": chunk_size})
            c.data.synthetic.num_train = max(c.data.synthetic.num_train, c.train.batch_size)
            try:
                setup = Setup(c)
                compiled = setup.compile(setup.batch(0))
                entry[label] = peak_bytes(compiled)
            except config_lib.ConfigError as e:
                entry[label] = f"invalid: {e}"
        out.append(entry)
    return out


def with_shape(config, shape: str, root: str):
    """`config` on a weightless checkpoint folder of the `shape` sizes (bench_shapes.SHAPES); decoders get the
    decoder presets' last-token pooling, remat and scanned layers."""
    hf_config, decoder = bench_shapes.SHAPES[shape]
    overrides = {"model.checkpoint": bench_shapes.checkpoint_folder(hf_config, root), "model.family": "auto"}
    if decoder:
        overrides.update({"model.pooling": "last", "model.remat": "auto", "model.scan_layers": True})
    return config_lib.override(ml_collections.ConfigDict(config.to_dict()), overrides)


def state_memory(config, records) -> dict:
    """Compile `config`'s step (no weights read or allocated) and report its state and compiled peak memory."""
    setup = Setup(config, records, weights=False, choose_remat=False)      # the decoders' remat: full
    abstract = setup.abstract
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))                # noqa: E731
    nbytes = lambda tree: sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    t0 = time.perf_counter()
    compiled = setup.compile(setup.batch(0))
    return {"trainable": size(abstract.params), "frozen": size(abstract.frozen),
            "trainable_bytes": nbytes(abstract.params), "frozen_bytes": nbytes(abstract.frozen),
            "optimizer_bytes": nbytes(abstract.opt_state), "peak_bytes_per_device": peak_bytes(compiled),
            "compile_s": time.perf_counter() - t0, "rows": setup.build.global_rows}


def lora_table(config, shapes: list[str], rank: int, root: str) -> list[dict]:
    """Full fine-tuning vs LoRA (without and with gradient caching) for each shape at 256/512 tokens, 32 records
    (96 rows) per device, bfloat16 compute."""
    rows = []
    chunk_rows = 24 * jax.device_count()         # gradient caching: a quarter of the 96 rows per device at a time
    for shape in shapes:
        for r, chunk in ((0, 0), (rank, 0), (rank, chunk_rows)):
            c = config_lib.override(with_shape(config, shape, root), {
                "data.query_max_len": 256, "data.passage_max_len": 512, "train.batch_size": 32 * jax.device_count(),
                "train.steps": 1, "model.dtype": "bfloat16", "model.lora.rank": r, "model.lora.base_dtype": "bfloat16",
                "train.chunk_size": chunk, "eval.synthetic": False, "eval.canary": ""})
            records = inf_ir_shaped_records(max(4 * c.train.batch_size, 256))
            mode = (f"lora r={r}, base bf16" if r else "full fine-tuning") + (f", chunk {chunk}" if chunk else "")
            rows.append({"shape": shape, "mode": mode, **state_memory(c, records)})
    return rows


def print_lora_table(rows: list[dict], device_bytes: float = 80e9) -> None:
    gb = lambda b: f"{b / 1e9:.1f} GB"    # noqa: E731
    print(f"{'model':<14} {'mode':<31} {'trainable':>14} {'weights':>9} {'optimizer':>10} "
          f"{'peak/device':>12}  fits {device_bytes / 1e9:.0f} GB")
    for r in rows:
        weights = r["trainable_bytes"] + r["frozen_bytes"]
        print(f"{r['shape']:<14} {r['mode']:<31} {r['trainable']:>14,} {gb(weights):>9} {gb(r['optimizer_bytes']):>10} {gb(r['peak_bytes_per_device']):>12}  "
              f"{'yes' if r['peak_bytes_per_device'] <= device_bytes else 'no'}")


def sweep_rows(text: str) -> list[int]:
    """--sweep_rows as row counts, or a UserError naming the flag."""
    try:
        rows = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise errors.UserError(f"--sweep_rows={text!r}: comma-separated global batch sizes in rows, each >= 1")
    return rows


def main(argv: list[str]) -> None:
    fv = _flags(argv)
    config = fv.config
    for flag, low in (("steps", 1), ("warmup", 0), ("sweep_chunk", 1)):
        if fv[flag].value < low:
            raise errors.UserError(f"--{flag}={fv[flag].value}: must be >= {low}")
    if not fv.peak_flops >= 0:
        raise errors.UserError(f"--peak_flops={fv.peak_flops}: must be >= 0 (0: from the device table)")
    rows_to_sweep = sweep_rows(fv.sweep_rows) if fv.sweep_rows else None
    if fv.shape and not (fv.compile_only or fv.lora_table):
        raise errors.UserError(f"--shape={fv.shape} has no weights: use it with --compile_only or --lora_table")
    if fv.vs_full and config.model.lora.rank == 0:
        raise errors.UserError("--vs_full compares a LoRA run with full fine-tuning: set --config.model.lora.rank")
    if fv.lora_table:
        unknown = [s for s in fv.lora_shapes.split(",") if s.strip() and s.strip() not in bench_shapes.SHAPES]
        if unknown or fv.lora_rank < 1:
            raise errors.UserError(f"--lora_shapes={fv.lora_shapes!r} / --lora_rank={fv.lora_rank}: shapes from "
                                 f"{list(bench_shapes.SHAPES)}, rank >= 1")
        root = tempfile.mkdtemp(prefix="infjax_lora_table_")
        try:
            print(f"devices: {platform.describe()}; objective {config.objective}; compiled (nothing allocated): "
                  f"AdamW, 32 records per device at 256/512 tokens, bfloat16 compute")
            print_lora_table(lora_table(config, [s.strip() for s in fv.lora_shapes.split(",") if s.strip()],
                                        fv.lora_rank, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    print(f"devices: {platform.describe()}; "
          f"model {config.model.checkpoint}, objective {config.objective}, dtype {config.model.dtype}; "
          f"{runtime_cpu.describe()}")
    if rows_to_sweep:
        rows = rows_to_sweep
        print(f"compiled peak memory per device (arguments + temporaries + outputs - aliased), MiB; "
              f"gradient caching with train.chunk_size={fv.sweep_chunk}")
        print(f"{'rows':>6}  {'plain':>12}  {'gradcache':>12}")
        for e in sweep(config, rows, fv.sweep_chunk):
            fmt = lambda v: f"{v / 2**20:12.1f}" if isinstance(v, int) else f"{v}"   # noqa: E731
            print(f"{e['rows']:>6}  {fmt(e['plain'])}  {fmt(e['gradcache'])}")
        return
    records = inf_ir_shaped_records(max(4 * config.train.batch_size * (fv.warmup + fv.steps), 256)) \
        if fv.data == "inf_ir_shaped" else None
    if fv.compile_only:
        if fv.shape:
            root = tempfile.mkdtemp(prefix="infjax_shape_")
            config = with_shape(config, fv.shape, root)
        setup = Setup(config, records, weights=False)        # shapes only: no weight file is read
        t0 = time.perf_counter()
        compiled = setup.compile(setup.batch(0))
        m = compiled.memory_analysis()
        packed = setup.build.packing
        print(f"mesh {dict(setup.mesh.shape)}, {setup.build.global_rows} rows per step, packing "
              f"{ {k: (c.rows, c.length) for k, c in (packed.capacities if packed else {}).items()} }; compiled in "
              f"{time.perf_counter() - t0:.1f} s")
        print(f"per device: peak {peak_bytes(compiled) / 2**30:.2f} GiB (arguments {m.argument_size_in_bytes / 2**30:.2f}"
              f", temporaries {m.temp_size_in_bytes / 2**30:.2f}, outputs {m.output_size_in_bytes / 2**30:.2f}, "
              f"aliased {m.alias_size_in_bytes / 2**30:.2f})")
        leaves = lambda tree: jax.tree.leaves(tree)      # noqa: E731
        print(f"trainable parameters {sum(x.size for x in leaves(setup.abstract.params)):,}, frozen "
              f"{sum(x.size for x in leaves(setup.abstract.frozen)):,}; optimizer state "
              f"{sum(x.size * x.dtype.itemsize for x in leaves(setup.abstract.opt_state)) / 2**30:.2f} GiB")
        if fv.shape:
            shutil.rmtree(root, ignore_errors=True)
        return
    r = throughput(config, fv.steps, fv.warmup, fv.peak_flops, records)
    shapes = r["setup"].build.packing.shapes if r["setup"].build.packing is not None else None
    packed = "off" if shapes is None else "; ".join(
        " ".join(f"{side} {n}x{shapes.lengths[side]}" for side, n in rows.items()) for rows in shapes.rows)
    print(f"mesh {r['mesh']}, {r['rows_per_step']} rows per step, chunk_size {config.train.chunk_size}, "
          f"packing {packed} ({r['shapes']} shape(s) in the timed steps); compile {r['compile_s']:.1f} s")
    print(f"step {r['step_s'] * 1e3:.1f} ms (median of {fv.steps})  {r['examples_per_s']:.1f} examples/s  "
          f"{r['tokens_per_s_padded']:.0f} tokens/s in buffers ({r['tokens_per_s_real']:.0f} real; real share "
          f"{100 * r['real_share']:.0f}%)")
    loop = r["loop"]
    print(f"real loop (batches from the run's pipeline, {loop['pipeline']}): step {loop['step_s'] * 1e3:.1f} ms "
          f"(mean of {fv.steps - 1})  {loop['examples_per_s']:.1f} examples/s  data wait "
          f"{100 * loop['data_wait_share']:.0f}%")
    mfu = "n/a (no peak FLOP/s for this device; pass --peak_flops)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    print(f"{r['flops_per_step_per_device'] / 1e9:.1f} GFLOP per step per device (model FLOPs of the real texts, "
          f"benchmarks/flops.py; XLA's cost_analysis says {r['compiled_flops_per_step_per_device'] / 1e9:.1f}); "
          f"MFU {mfu}; "
          f"peak memory {r['peak_memory_per_device_bytes'] / 2**20:.1f} MiB per device (compiled); process max RSS "
          f"{_max_rss_mib():.0f} MiB")
    if fv.vs_full:
        full = throughput(config_lib.override(ml_collections.ConfigDict(config.to_dict()), {"model.lora.rank": 0}),
                          fv.steps, fv.warmup, fv.peak_flops, records)
        print(f"full fine-tuning (same rows): step {full['step_s'] * 1e3:.1f} ms (median of {fv.steps})  "
              f"{full['examples_per_s']:.1f} examples/s; peak memory {full['peak_memory_per_device_bytes'] / 2**20:.1f}"
              f" MiB per device (compiled)")
        print(f"steps/s LoRA (rank {config.model.lora.rank}) {1 / r['step_s']:.3f}, full {1 / full['step_s']:.3f}: "
              f"ratio LoRA / full {full['step_s'] / r['step_s']:.2f}x; compiled GFLOP per step per device LoRA "
              f"{r['compiled_flops_per_step_per_device'] / 1e9:.4g}, full "
              f"{full['compiled_flops_per_step_per_device'] / 1e9:.4g}")
    if fv.vs_torch:
        build = r["setup"].build
        steps = [[build.step_texts.side_texts(i, local=False)[0][s] for s in ("q", "p")]
                 for i in range(fv.warmup + fv.steps)]
        t = torch_loop.run_in_child(steps, fv.warmup, config)
        print(f"pytorch loop (same rows, dynamic padding, {t['threads']} threads): step {t['step_s'] * 1e3:.1f} ms "
              f"(median of {fv.steps})  {r['rows_per_step'] / t['step_s']:.1f} examples/s  real share "
              f"{100 * t['real_share']:.0f}%  max RSS {t['max_rss_mib']:.0f} MiB")
        print(f"ratio infjax / pytorch: {t['step_s'] / r['step_s']:.2f}x")
        # Where dense matmuls dominate (CPU), the step's time follows its encoder tokens: their ratio is the
        # speed-up that equal per-token speed would give, and the per-token times say how far each is from it.
        mine, theirs = r["tokens_per_step"], t["tokens_per_step"]
        print(f"encoder tokens per step: infjax {mine:.0f} in packed buffers ({r['real_tokens_per_step']:.0f} real), "
              f"pytorch {theirs:.0f} padded ({t['real_tokens_per_step']:.0f} real); ratio {theirs / mine:.2f}x; "
              f"per token: infjax {r['step_s'] / mine * 1e6:.0f} us, pytorch {t['step_s'] / theirs * 1e6:.0f} us")


def _max_rss_mib() -> float:
    return torch_loop.peak_rss_mib()
