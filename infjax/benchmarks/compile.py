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
from infjax.data import pipeline
from infjax.models import attention, kernels
from infjax.models.encoder import query_params
from infjax.runtime import targets
from infjax.models import remat as remat_lib
from infjax.training import remat_choice, setup as setup_lib

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
    flags.DEFINE_string("out", None, "also write the report as JSON to this file", flag_values=fv)


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
    remat: str = ""                  # the remat policy of the step reported (auto: the one it takes)
    remat_line: str = ""             # auto's line, as a run logs it
    remat_table: list = dataclasses.field(default_factory=list)  # auto: policy_row of every policy

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
                "kernels": self.kernels, "bf16_sums": self.bf16_sums, "remat": self.remat,
                "remat_auto": self.remat_line, "remat_policies": self.remat_table,
                "allocator_bytes": allocator_bytes(self.target),
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


# What JAX's GPU allocator may hold of a GPU's memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION; a TPU's is
# all of it): what `model.remat=auto` compares a compiled peak with on the device.
GPU_MEMORY_FRACTION = 0.75


def allocator_bytes(target: targets.Target) -> int:
    """What a run's allocator holds of one device of `target` (`memory_stats()["bytes_limit"]` there)."""
    if target.family != "cuda":
        return target.memory
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "")
    try:
        share = float(fraction) if fraction else GPU_MEMORY_FRACTION
    except ValueError:
        share = GPU_MEMORY_FRACTION
    return int(target.memory * share)


# A program computes at least its model FLOPs (less at most what packing leaves out of the analytic count);
# a count of its matmuls below this share of them means they were not all read (docs/benchmarks.md: XLA:TPU's
# loops carry no known trip count, and it writes some matmuls as convolutions this reader does not price), and
# no FLOPs are reported for it.
UNREAD = 0.9

# Bytes per second between a device and its host's pinned memory, each way (PCIe Gen5 x16, an H100's or H200's
# link; about what a TPU host's is too): what offload's transfers cost at best.
HOST_LINK = 50e9


@dataclasses.dataclass
class Compiled:
    """One remat policy's compile of the step."""
    policy: str
    compiled: object | None
    refused: str | None
    lowered_text: str
    memory: dict[str, int]
    compile_s: float


def _compile(setup, policy: str, batch) -> Compiled:
    t0 = time.perf_counter()
    step = setup.step if policy == setup.remat else setup.step_for(policy)
    with kernels.lowering():
        lowered = step.trace(*setup.abstract_inputs(batch)).lower()
    text = lowered.as_text()
    refused, compiled = None, None
    try:
        compiled = lowered.compile()
    except Exception as err:      # noqa: BLE001 - a target's compiler refusing (TPU HBM) is the answer
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "exceed" not in line.lower() and "memory" not in line.lower():
            raise
        refused = line[:400]
    memory = {"arguments": 0, "temporaries": 0, "outputs": 0, "aliased": 0, "peak": 0}
    if compiled is not None:
        m = compiled.memory_analysis()
        memory = {"arguments": int(m.argument_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
                  "outputs": int(m.output_size_in_bytes), "aliased": int(m.alias_size_in_bytes),
                  "peak": setup_lib.peak_bytes(compiled)}
    return Compiled(policy, compiled, refused, text, memory, time.perf_counter() - t0)


def table_policies() -> tuple[str, ...]:
    """The policies `auto` chooses from, then offload where the target can offload (inside `kernels.targeting`)."""
    extra = ("offload",) if remat_lib.offload_supported() else ()
    return remat_lib.RECOMPUTE_ORDER + extra


def compile_step(config, target: targets.Target, records: list[dict] | None = None, devices=None) -> Report:
    """Compile `config`'s train step for `target` (its compile-only devices unless `devices` are given).

    With `model.remat=auto`, every policy is compiled (`remat_table` of the report) and the report is of the one that
    `auto` takes on the target."""
    devices = devices if devices is not None else targets.devices(target)
    config_lib.validate(config, target.count, target.hosts)      # as a run of `target.hosts` processes would be
    t0 = time.perf_counter()
    auto = remat_lib.normalize(config.model.remat) == "auto"
    with kernels.targeting(devices), attention.recorded() as calls:
        setup = bench_train.Setup(config, records, weights=False, devices=devices, choose_remat=False)
        step = pipeline.widest_step(setup.build)
        host_batch = setup.build(step)
        batch = setup.abstract_batch(step)
        asked = remat_lib.normalize(config.model.remat)       # offload falls back to full where it cannot
        asked = asked if asked != "offload" or "offload" in table_policies() else "full"
        results = {p: _compile(setup, p, batch) for p in (table_policies() if auto else (asked,))}
    lora = setup.encoder.lora is not None
    flops = flops_lib.step_flops(query_params(setup.params), setup.encoder.module.config,
                                 flops_lib.text_lengths(host_batch), frozen_base=lora)
    line, table = "", []
    chosen = results[asked] if not auto else None
    if auto:
        def tried(policy):
            r = results[policy]
            return remat_choice.Tried(policy, r.memory["peak"] if r.refused is None else None, r.refused)
        choice = remat_choice.choose(tried, allocator_bytes(target), agree=lambda i: i)
        chosen, line = results[choice.policy], choice.line
        table = [policy_row(r, flops, target) for r in results.values()]
    program = chosen.compiled.as_text() if chosen.compiled else ""
    report = Report(target, config, chosen.compiled, list(calls), custom_call_counts(program), chosen.memory, flops,
                    setup.build.global_rows, chosen.lowered_text, time.perf_counter() - t0, chosen.refused,
                    kernels=hlo.kernel_counts(program) if chosen.compiled else {},
                    bf16_sums=hlo.low_precision_sums(program))
    report.remat, report.remat_line, report.remat_table = chosen.policy, line, table
    return report


def policy_row(r: Compiled, flops: flops_lib.StepFlops, target: targets.Target) -> dict:
    """One policy's line of the table: its peak, the FLOPs its program computes per device, and the step time.

    The FLOPs are the matmuls read from the compiled program, recompute included (attention kernels, custom calls, at
    their analytic FLOPs); the step time is the one those FLOPs give at 40% and 60% of the device's bf16 peak."""
    peak = r.memory["peak"] if r.refused is None else None
    row = {"policy": r.policy, "peak_bytes": peak, "refused": r.refused, "compile_s": r.compile_s,
           "fits": remat_choice.fits(remat_choice.Tried(r.policy, peak, r.refused), allocator_bytes(target))}
    if r.compiled is not None:
        program = r.compiled.as_text()
        matmul = hlo.matmul_flops(program)
        kernel_attention = flops.attention / target.count if custom_call_counts(program) else 0.0
        computed = matmul + kernel_attention
        model = flops.total / target.count
        if computed < UNREAD * model:       # e.g. XLA:TPU's matmuls as convolutions of its own, loops without a
            row.update({"matmul_flops": matmul, "computed_flops": None, "model_flops": model})   # known trip count
            return row
        row.update({"matmul_flops": matmul, "computed_flops": computed, "model_flops": model,
                    "beyond_model": computed / model - 1 if model else None,
                    **{f"step_s_at_{u}": computed / (u / 100 * target.peak_flops) for u in (40, 60)},
                    **{f"mfu_at_{u}": u / 100 * model / computed for u in (40, 60)}})
    return row


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
          f"{lora}, {c.model.dtype}{', remat ' + r.remat if r.remat else ''}, objective {c.objective}, mesh "
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
    if r.remat_table:
        print_policies(r)
    per_device = r.flops.total / r.target.count
    print(f"model FLOPs per step (analytic, {r.flops.texts} texts, {r.flops.tokens} real tokens): "
          f"{r.flops.total / 1e12:.2f} TFLOP ({per_device / 1e12:.2f} per device; dense {r.flops.dense / 1e12:.2f}, "
          f"attention {r.flops.attention / 1e12:.2f}); at 40% of the {r.target.peak_flops / 1e12:.0f} TFLOP/s bf16 "
          f"peak: {per_device / (0.4 * r.target.peak_flops) * 1e3:.0f} ms per step")


def policy_lines(r: Report) -> list[str]:
    """The remat policies' table of an `auto` report, one line per policy, and auto's choice."""
    peak = r.target.peak_flops
    lines = [f"remat policies (model.remat=auto), per device: peak memory; TFLOP computed per step (the compiled "
             f"program's matmuls, attention kernels at their analytic FLOPs) and how much that is beyond the model "
             f"FLOPs (recompute, padding, and XLA's own rematerialisation of a program over the memory); step time "
             f"and MFU if the device computes at 40% / 60% of its {peak / 1e12:.0f} TFLOP/s bf16 peak:",
             f"  {'policy':<16} {'peak':>9} {'fits':>5} {'TFLOP':>8} {'beyond':>7} {'step@40%':>9} {'step@60%':>9} "
             f"{'MFU@40%':>8} {'MFU@60%':>8}"]
    for row in r.remat_table:
        if row["refused"]:
            lines.append(f"  {row['policy']:<16} refused by the compiler: {row['refused'][:90]}")
            continue
        if row.get("computed_flops") is None:
            lines.append(f"  {row['policy']:<16} {row['peak_bytes'] / 1e9:>6.2f} GB {'yes' if row['fits'] else 'no':>5} "
                         f"{'n/a: the compiled matmuls could not all be read':>53}")
            continue
        lines.append(f"  {row['policy']:<16} {row['peak_bytes'] / 1e9:>6.2f} GB {'yes' if row['fits'] else 'no':>5} "
                     f"{row['computed_flops'] / 1e12:>8.1f} {row['beyond_model']:>+7.0%} "
                     f"{row['step_s_at_40'] * 1e3:>6.0f} ms {row['step_s_at_60'] * 1e3:>6.0f} ms "
                     f"{row['mfu_at_40']:>8.1%} {row['mfu_at_60']:>8.1%}")
    rows = {row["policy"]: row for row in r.remat_table if not row["refused"]}
    if "offload" in rows and "dots" in rows:
        moved = max(rows["dots"]["peak_bytes"] - rows["offload"]["peak_bytes"], 0)
        lines.append(f"  offload's step times leave out its transfers: about {moved / 1e9:.1f} GB (dots' peak less "
                     f"offload's) go to the host and back each step: {moved / HOST_LINK * 1e3:.0f} ms each way at "
                     f"{HOST_LINK / 1e9:.0f} GB/s, which compute can hide only if it takes longer")
    lines.append(f"  auto on this target ({allocator_bytes(r.target) / 1e9:.1f} GB for JAX's allocator"
                 f"{' at its default 75%' if r.target.family == 'cuda' and not os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION') else ''}): "
                 f"{r.remat_line}")
    return lines


def print_policies(r: Report) -> None:
    print("\n".join(policy_lines(r)))


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
