"""Will a run fit, and which kernels will it use, on hardware that is not here: `python -m infjax.bench compile`.

    python -m infjax.bench compile --config=configs/multi_pi.py --target=h100
    python -m infjax.bench compile --config=configs/multi_pi.py --target=h100 --shape=qwen2.5-1.5b --paper
    python -m infjax.bench compile --config=configs/multi_pi.py --target=h100x8 --shape=qwen2.5-7b --paper \\
        --config.model.lora.rank=16 --config.model.lora.base_dtype=bfloat16
    python -m infjax.bench compile --config=configs/multi_pi.py --target=v5e-16 --shape=bert-base --paper
    python -m infjax.bench compile --config=configs/multi_pi.py --target=h100x8 --hosts=4 --shape=qwen2.5-7b --paper \\
        --config.mesh.data=1 --config.mesh.fsdp=32

Compiles the run's train step, exactly as `infjax.train` builds it, for the devices of --target (JAX's
compile-only GPU or TPU devices, infjax/runtime/targets.py: no device, driver or weights needed; batches are
sized by the target's device count) and prints, per device: the peak memory of the compiled step (arguments,
temporaries, outputs) against the device's memory, the attention each encoder pass traced and the kernels in
the compiled program (cuDNN's fused attention, Triton, Mosaic custom calls), and the step's model FLOPs
(benchmarks/flops.py: analytic, per real token; what a utilization figure divides by). The batch compiled is
that of the run's widest packed shape (the one that holds every step).

--shape swaps the checkpoint for a config.json of the paper's backbones (no weights: bert-base, e5-large,
qwen2.5-1.5b, qwen2.5-7b); --paper sets the paper's batch: 32 records per device with hard negatives, 256-token
queries and 512-token passages, bfloat16, records with InF-IR's lengths; a `--config.KEY=VALUE` of any of these
keys on the command line wins over --paper, as everywhere. --hosts=N compiles for N hosts of the GPU target (JAX's
compile-only topology 1xNxG: the program each of the job's N processes would run); a TPU slice's name gives its
hosts. What a compile-only target cannot say: cuDNN's workspace (sized by cuDNN on the device, not in the
figures), autotuning, the time of the collectives between hosts, and speed.

Needs the target's compiler: `pip install -e ".[gpu-compile]"` or `".[tpu-compile]"` (a missing one is named).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import shutil
import tempfile
import time

import jax
import ml_collections
from absl import flags

from infjax import cli, config as config_lib, errors
from infjax.benchmarks import flops as flops_lib, hlo, shapes as bench_shapes, train as bench_train
from infjax.models import attention, kernels
from infjax.models.encoder import query_params
from infjax.runtime import targets

PAPER = {"data.query_max_len": 256, "data.passage_max_len": 512, "model.dtype": "bfloat16", "train.steps": 1,
         "data.hard_negatives": True, "eval.synthetic": False, "eval.canary": ""}
RECORDS_PER_DEVICE = 32


def define_flags(fv: flags.FlagValues) -> None:
    cli.define_config(fv, "Config file, e.g. configs/multi_pi.py[:preset]; --config.KEY=VALUE overrides a key.",
                      lock_config=False)
    flags.DEFINE_string("target", None, "what to compile for: a GPU (h100, h200, a100-80, a100-40; xN for N of one "
                        "host: 1, 2, 4 or 8, e.g. h100x8) or a TPU slice (v5e-4, v5e-16, v6e-8, v5p-8, v5p-128, "
                        "v5e-256, v4-8, ...)", flag_values=fv)
    flags.DEFINE_integer("hosts", 1, "hosts of the GPU target, each with the --target's GPUs (e.g. --target=h100x8 "
                         "--hosts=4: 32 H100s); a TPU slice's name gives its hosts", flag_values=fv)
    flags.DEFINE_enum("shape", "", ["", *bench_shapes.SHAPES], "the model is a config.json of these sizes (no "
                      "weights) instead of config.model.checkpoint", flag_values=fv)
    flags.DEFINE_bool("paper", False, f"the paper's batch: {RECORDS_PER_DEVICE} records per device, 256/512 tokens, "
                      "bfloat16, InF-IR-shaped records (a --config.KEY=VALUE of these keys wins)", flag_values=fv)
    flags.DEFINE_string("out", "", "also write the report as JSON to this file", flag_values=fv)


def _flags(argv):
    return cli.parse("python -m infjax.bench compile", define_flags, argv, doc=__doc__.split("\n\n")[0],
                     required=("config", "target"), after=cli.load_config, catch=cli.CONFIG_ERRORS,
                     message=cli.config_flag_error)


@dataclasses.dataclass
class Report:
    target: targets.Target
    config: ml_collections.ConfigDict
    compiled: object | None          # jax.stages.Compiled; None where the compiler refused (see `refused`)
    calls: list                      # attention.Call of every attention call traced
    custom_calls: dict[str, int]
    memory: dict[str, int]           # bytes per device: arguments, temporaries, outputs, aliased, peak
    flops: flops_lib.StepFlops
    rows: int                        # rows per step
    lowered_text: str
    compile_s: float
    refused: str | None = None       # the compiler's reason, e.g. TPU HBM exceeded
    label: str = ""                  # the model's name in the report (default: config.model.checkpoint)
    kernels: dict = dataclasses.field(default_factory=dict)      # hlo.kernel_counts of the compiled step
    bf16_sums: list = dataclasses.field(default_factory=list)    # hlo.low_precision_sums of the compiled step

    @property
    def fits(self) -> bool:
        return self.refused is None and self.memory["peak"] <= self.target.memory

    def as_dict(self) -> dict:
        c = self.config
        return {"target": self.target.name, "device": self.target.kind, "devices": self.target.count,
                "hosts": self.target.hosts, "model": self.label or c.model.checkpoint, "lora_rank": c.model.lora.rank,
                "dtype": c.model.dtype, "mesh": dict(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor),
                "records_per_step": c.train.batch_size, "records_per_device": c.train.batch_size / self.target.count,
                "hard_negatives": bool(c.data.hard_negatives), "query_max_len": c.data.query_max_len,
                "passage_max_len": c.data.passage_max_len,
                "jax": jax.__version__, "rows_per_step": self.rows, "memory_per_device": self.memory,
                "device_memory": self.target.memory, "fits": self.fits, "refused": self.refused,
                "attention": [describe(c) for c in distinct(self.calls)], "custom_calls": self.custom_calls,
                "kernels": self.kernels, "bf16_sums": self.bf16_sums,
                "flops_per_step": self.flops.total, "flops_per_step_per_device": self.flops.total / self.target.count,
                "dense_flops": self.flops.dense, "attention_flops": self.flops.attention,
                "real_tokens": self.flops.tokens, "texts": self.flops.texts, "compile_s": self.compile_s}


KERNELS = ("__cudnn", "__gpu$xla.gpu.triton", "tpu_custom_call")     # the custom calls of attention kernels


def custom_call_counts(hlo: str) -> dict[str, int]:
    """The attention kernels of a compiled program's text and how many calls of each: cuDNN's and Triton's by
    their custom-call target, TPU Mosaic kernels by their names (e.g. splash_mha_fwd_segmented)."""
    found: collections.Counter = collections.Counter()
    for name, target in re.findall(r'^\s*(?:ROOT )?%([\w.$-]+) = .*custom-call\(.*custom_call_target="([^"]+)"', hlo,
                                   re.MULTILINE):
        if target.startswith(KERNELS):
            stem = re.sub(r"(\.[0-9]+)+$", "", name)          # splash_mha_fwd_segmented.24 -> splash_mha_fwd_segmented
            found[f"{target}:{stem}" if target == "tpu_custom_call" else target] += 1
    return dict(sorted(found.items()))


def widest_step(build) -> int:
    """A step packed in the run's widest shape (the first: it holds every step); step 0 when not packed."""
    shapes = getattr(build, "shapes", None)
    if shapes is None:
        return 0
    return int(next((i for i, s in enumerate(shapes.of_step) if s == 0), 0))


def compile_step(config, target: targets.Target, records: list[dict] | None = None, devices=None) -> Report:
    """Compile `config`'s train step for `target` (its compile-only devices unless `devices` are given)."""
    devices = devices if devices is not None else targets.devices(target)
    config_lib.validate(config, target.count, target.hosts)      # as a run of `target.hosts` processes would be
    t0 = time.perf_counter()
    with kernels.targeting(devices), attention.recorded() as calls:
        setup = bench_train.Setup(config, records, weights=False, devices=devices)
        step = widest_step(setup.build)
        host_batch = setup.build(step)
        batch = setup.abstract_batch(step)
        with kernels.lowering():
            lowered = setup.step.trace(*setup.abstract_inputs(batch)).lower()
        text = lowered.as_text()
        refused, compiled = None, None
        try:
            compiled = lowered.compile()
        except Exception as err:      # noqa: BLE001 - a target's compiler refusing (TPU HBM) is the answer
            line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if "exceeds" not in line and "memory" not in line.lower():
                raise
            refused = line[:400]
    memory = {"arguments": 0, "temporaries": 0, "outputs": 0, "aliased": 0, "peak": 0}
    if compiled is not None:
        m = compiled.memory_analysis()
        memory = {"arguments": int(m.argument_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
                  "outputs": int(m.output_size_in_bytes), "aliased": int(m.alias_size_in_bytes),
                  "peak": bench_train.peak_bytes(compiled)}
    lora = setup.encoder.lora is not None
    flops = flops_lib.step_flops(query_params(setup.params), setup.encoder.module.config,
                                 flops_lib.text_lengths(host_batch), frozen_base=lora)
    program = compiled.as_text() if compiled else ""
    return Report(target, config, compiled, list(calls), custom_call_counts(program), memory, flops,
                  setup.build.global_rows, text, time.perf_counter() - t0, refused,
                  kernels=hlo.kernel_counts(program) if compiled else {},
                  bf16_sums=hlo.low_precision_sums(program))


def distinct(calls) -> list:
    """The distinct attention calls (a layer stack traces the same call once per layer, or once when scanned)."""
    return list(dict.fromkeys(calls))


def describe(call) -> str:
    b, t, n, d = call.shape
    mask = "causal" if call.causal else "bidirectional"
    if call.window is not None:
        mask += f", window {call.window}"
    heads = f"{n} heads" if call.kv_heads == n else f"{n} query / {call.kv_heads} kv heads"
    return (f"{b} rows x {t} tokens (at most {call.max_segments} texts a row), {heads} of {d}, {call.dtype}, {mask}: "
            f"{call.choice.impl} ({call.choice.reason})")


def paper_config(config, target: targets.Target, shape: str, root: str, given=()):
    """`config` at the paper's batch for `target`'s device count (and on `shape`'s config.json if given), but for
    the keys in `given` (set on the command line: they win)."""
    if shape:
        config = bench_train.with_shape(config, shape, root)
    paper = dict(PAPER, **{"train.batch_size": RECORDS_PER_DEVICE * target.count})
    return config_lib.override(ml_collections.ConfigDict(config.to_dict()),
                               {k: v for k, v in paper.items() if k not in set(given)})


def given_keys(fv) -> list[str]:
    """The config keys set on the command line (--config.KEY=VALUE)."""
    return [name[len("config."):] for name in fv if name.startswith("config.") and fv[name].present]


def print_report(r: Report) -> None:
    gb = lambda b: f"{b / 1e9:.2f} GB"     # noqa: E731
    c = r.config
    lora = f", LoRA rank {c.model.lora.rank}" if c.model.lora.rank else ""
    records_per_device = c.train.batch_size / r.target.count
    print(f"target: {r.target.describe()}, compile-only; jax {jax.__version__}; model {r.label or c.model.checkpoint}"
          f"{lora}, {c.model.dtype}, objective {c.objective}, mesh "
          f"{dict(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor)}; {c.train.batch_size} records per step "
          f"({records_per_device:g} per device), hard negatives {'on' if c.data.hard_negatives else 'off'}: "
          f"{r.rows} rows; "
          f"{c.data.query_max_len}/{c.data.passage_max_len} tokens (queries/passages); compiled in {r.compile_s:.0f} s")
    print("attention (each distinct call traced):")
    for call in distinct(r.calls):
        print(f"  {describe(call)}")
    if r.custom_calls:
        print("attention kernels in the compiled step: " + ", ".join(f"{k} x{v}" for k, v in r.custom_calls.items()))
    if r.kernels:
        sums = (f"{len(r.bf16_sums)} sums in bf16 (e.g. {r.bf16_sums[0]})" if r.bf16_sums else
                "every sum in float32")
        print(f"kernels: {r.kernels['kernels']} in the compiled step, {r.kernels['launches']} launched per step "
              f"(loop bodies once per trip); {sums}")
    m = r.memory
    if r.refused:
        print(f"memory per device: the compiler refused the step: {r.refused}")
    else:
        print(f"memory per device: peak {gb(m['peak'])} (arguments {gb(m['arguments'])}, temporaries "
              f"{gb(m['temporaries'])}, outputs {gb(m['outputs'])}, aliased {gb(m['aliased'])}) of "
              f"{gb(r.target.memory)}: {'fits' if r.fits else 'does NOT fit'}"
              + (" (cuDNN's workspace not included)" if r.target.family == "cuda" else ""))
    per_device = r.flops.total / r.target.count
    print(f"model FLOPs per step (analytic, {r.flops.texts} texts, {r.flops.tokens} real tokens): "
          f"{r.flops.total / 1e12:.2f} TFLOP ({per_device / 1e12:.2f} per device; dense {r.flops.dense / 1e12:.2f}, "
          f"attention {r.flops.attention / 1e12:.2f}); at 40% of the {r.target.peak_flops / 1e12:.0f} TFLOP/s bf16 "
          f"peak: {per_device / (0.4 * r.target.peak_flops) * 1e3:.0f} ms per step")


def check_out(out: str) -> None:
    """--out must be a file this process can write (checked before minutes of compiling)."""
    if not out:
        return
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise errors.UserError(f"--out={out}: is a folder; name the JSON file to write, e.g. "
                               f"{os.path.join(out, 'compile.json')}")
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise errors.UserError(f"--out={out}: {folder} is not a writable folder")
    if os.path.exists(out) and not os.access(out, os.W_OK):
        raise errors.UserError(f"--out={out}: not writable")


def main(argv: list[str]) -> None:
    fv = _flags(argv)
    target = targets.parse(fv.target, fv.hosts)
    check_out(fv.out)
    devices = targets.devices(target)                   # before any work: a missing compiler is named at once
    root = tempfile.mkdtemp(prefix="infjax_compile_")
    try:
        config = fv.config
        records = None
        if fv.paper:
            config = paper_config(config, target, fv.shape, root, given_keys(fv))
            records = bench_shapes.inf_ir_shaped_records(max(4 * config.train.batch_size, 256))
        elif fv.shape:
            config = bench_train.with_shape(config, fv.shape, root)
        report = compile_step(config, target, records, devices)
        report.label = fv.shape
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_report(report)
    if fv.out:
        with open(fv.out, "w", encoding="utf-8") as f:
            json.dump(report.as_dict(), f, indent=2)
