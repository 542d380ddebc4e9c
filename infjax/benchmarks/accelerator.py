"""Is infjax right and fast on this machine? `python -m infjax.bench accelerator [--out=FILE.json]`.

One command for a machine with one GPU (or a TPU VM), in 8 minutes (`--budget_s`); prints a short table and
writes one JSON file (default accelerator.json in the working directory), again after each section, so that a
run cut short keeps what it measured. The sections run in this order (`--sections=` picks some):

- ``numerics``: a few training steps of a tiny random BERT and a tiny random Qwen2 in bfloat16 and float32 from
  the same parameters on the same batch (the project's train step, one batch every step, so that the loss
  must fall): both loss curves and their largest relative difference, against a tolerance; and one gradient
  of every parameter, bf16 against float32, leaf by leaf (benchmarks/gradients.py: a loss curve cannot show a
  gradient summed in bf16), with the worst leaves.
- ``scale`` (accelerators, full form): the paper's shapes with random weights (no hub): BERT-base (e5-base-v2's
  sizes) and Qwen2.5-1.5B (remat auto, scanned layers) at query/passage max lengths 256/512, bfloat16, 32 records
  per batch with hard negatives: step time (every compiled batch shape run once before the timing), real
  tokens/s, MFU from the analytic model FLOPs of the step's real texts (benchmarks/flops.py; XLA's count,
  which sees a scanned layer once and kernels as free, is kept beside it as `compiled_flops_per_step`), peak
  device memory measured and as compiled, and the attention used. With `--profile`, a `jax.profiler` trace of
  3 more steps of each shape, summarised as the kernels that took the most time and the sum of every kernel's
  time against the step's wall time (benchmarks/profile.py).
  ``vs_torch`` (where torch has a CUDA device): the same rows through a plain PyTorch loop on the same
  device: HF transformers with sdpa attention, unpacked (each batch padded to its longest text), eager (no
  torch.compile), bf16 autocast, AdamW, in-batch softmax; rows/s of both and their ratio. The ratio therefore
  includes packing's gain, not only the kernels'. The torch loop runs in a child process; so that both fit on
  one device, JAX is given half of the device memory in the full form (XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
  unless already set).
- ``attention``: for each family's attention shape (BERT; ModernBERT's local-window and global layers; Llama's
  and Qwen2's causal grouped-query attention) on packed rows (several texts of random lengths per row and a
  padding tail, traced with the bound on texts per row that a packed batch carries) and, for the decoders,
  on left-padded rows of one text each (what padded inference and `data.packing=False` give), in float32 and
  bfloat16, for every implementation of the platform (`attention.CANDIDATES`) plus "xla" and "explicit": the
  implementation `attention.choose` picks when asked for it (a fallback shows), the largest difference of the
  outputs and of the q/k/v gradients on the real tokens from "explicit" in float32 at the highest matmul
  precision (tolerances per platform: float32 dots are TF32 on GPUs and bf16 passes on TPUs by default), the
  largest q/k/v gradient at padding tokens (must be exactly 0 and finite), and the
  forward+backward time (median after warm-up).

The full form keeps to `--budget_s` (480): a scale shape, a PyTorch loop or an attention case starts only if
the time it is expected to take (EXPECTED_S) is left, else it is recorded as skipped. On CPU the reduced form
runs (also with --reduced): tiny shapes, the GPU ("pallas") and TPU ("splash") kernels in Pallas interpret
mode, a few numerics steps; ``scale`` and ``vs_torch`` are recorded as skipped. Each section records
``{"error": ...}`` instead of stopping the command, so the JSON always comes out.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from infjax import cli, config as config_lib, errors
from infjax.benchmarks import flops as flops_lib, gradients, profile as profile_lib, shapes, train as bench_train
from infjax.data import packing
from infjax.data.batches import real_tokens
from infjax.models import attention, kernels
from infjax.models.encoder import query_params
from infjax.runtime import cpu as runtime_cpu, platform
from infjax.training import state as state_lib

# Attention shapes of the families: (query heads, kv heads, head size, causal, window). ModernBERT's local
# layers see 64 tokens each side (its local_attention 128), its global layers the whole text.
SHAPES = {
    "bert": (12, 12, 64, False, None),
    "modernbert-local": (12, 12, 64, False, 64),
    "modernbert-global": (12, 12, 64, False, None),
    "llama": (32, 8, 64, True, None),
    "qwen2": (12, 2, 128, True, None),
}
# Reduced form: fewer heads (the same query/kv ratio where small enough), the same head sizes, a window that
# is shorter than the texts of a 128-token row.
REDUCED_HEADS = {"bert": (2, 2), "modernbert-local": (2, 2), "modernbert-global": (2, 2), "llama": (4, 1),
                 "qwen2": (2, 1)}
REDUCED_WINDOW = 16
REDUCED_SAME = ("modernbert-global",)    # with the reduced heads, the very shape of "bert": not run twice
FULL_ROWS, REDUCED_ROWS = (8, 2048), (2, 128)

# Largest difference from explicit float32 at the highest matmul precision, relative to the largest |value| of
# the reference. float32: on a CPU the implementations differ in summation order and exp/rescaling only (~1e-6);
# GPUs multiply float32 in TF32 by default (10-bit mantissa, ~5e-4 per product), TPUs in bfloat16 passes.
# bfloat16: inputs and outputs are rounded to an 8-bit mantissa (2^-9 ~ 2e-3 relative per value) and the kernels
# multiply the probabilities in bf16 as well, so the gradients (sums over a row of such products) are ~1e-2 off.
TOLERANCE = {("float32", "cpu"): 1e-4, ("float32", "gpu"): 3e-3, ("float32", "tpu"): 3e-2, ("bfloat16", None): 3e-2}


def tolerance(dtype: str, platform_name: str) -> float:
    return TOLERANCE.get((dtype, platform_name), TOLERANCE.get((dtype, None), TOLERANCE[("float32", "tpu")]))

# Numerics: losses of bf16 and f32 training from the same start. Each bf16 op is ~3e-3 relative off; 30 steps of
# AdamW at a small learning rate move the parameters little, so the curves stay within a few percent of each
# other (relative to the loss, about log(batch) ~ 2-4) -- a broken kernel or cast gives NaN or losses that differ
# by tens of percent. Pass: every step's |bf16 - f32| <= max(NUMERICS_REL * |f32|, NUMERICS_ABS).
NUMERICS_REL, NUMERICS_ABS = 0.05, 0.05
# The numerics section also compares every parameter's gradient, bf16 against float32 (benchmarks/gradients.py):
# a loss curve cannot show an embedding table whose gradient is summed in bf16. The report keeps the worst leaves.
# Its models are drawn as at init (norm scales 1, biases 0), where the gradients that sum over every token of the
# batch (BERT's token-type row, the biases) nearly cancel: each term's bf16 rounding then shows against a small
# total. On a CPU (2026-11-27) those leaves were up to 17% off in the full form's BERT (its word and position
# tables 1.1% and 2.3%), 4.7% in the reduced one; with the sums taken in bf16 they were 360% to 1,270% off.
NUMERICS_WORST, NUMERICS_GRAD_TOLERANCE = 5, 0.3

def _tiny(base: dict, hidden: int, layers: int, heads: int, kv: int | None, intermediate: int) -> dict:
    out = dict(base, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
               intermediate_size=intermediate)
    if kv is not None:
        out["num_key_value_heads"] = kv
    if base["model_type"] == "qwen2":
        out["vocab_size"] = 30522
    return out


def _error(e: BaseException) -> dict:
    line = (str(e).strip().splitlines() or [""])[0][:500]
    return {"error": f"{type(e).__name__}: {line}"}


class Budget:
    """The command's wall-clock budget: a unit of work (an attention case, a scale shape, the PyTorch loop) starts
    only if the time it is expected to take is left; else it is recorded as skipped, naming the budget. 0: none."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def refuse(self, expected_s: float) -> str | None:
        """Why a unit expected to take `expected_s` seconds must not start, or None."""
        if not self.seconds:
            return None
        left = self.seconds - (time.perf_counter() - self.start)
        if left >= expected_s:
            return None
        return (f"skipped: {max(left, 0):.0f} s left of --budget_s={self.seconds:g}, this takes about "
                f"{expected_s:.0f} s")


# Expected seconds of each unit on one H100 or H200, from the H200 run of 2026-11-27 (docs/benchmarks.md): a scale
# shape (compile, 10 steps, a profile) and the PyTorch loop of one shape (its child process, model and steps);
# an attention case (its float32 reference and every implementation, both dtypes, compiled and timed).
# The H200 run's numerics took 94 s, and its two scale shapes with their PyTorch loops 328 s (~110 + 55 s a shape).
# A decoder's shape compiles its step under each remat policy `auto` tries (from full back to the first that
# does not fit: two or three for Qwen2.5-1.5B in half a device), about 50 s each on top.
EXPECTED_S = {"scale": 110.0, "scale_decoder": 210.0, "torch": 55.0, "attention": 25.0}
BUDGET_S = 480.0          # the full form's default: 8 minutes


# ----------------------------------------------------------------------------------------------- attention

def left_padded_segments(rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
    """Segment ids [rows, length] of one text a row that ends the row (a decoder's padded batch), after a
    padding of random length (the first row is full)."""
    ids = np.zeros((rows, length), np.int32)
    for r in range(rows):
        ids[r, 0 if r == 0 else int(rng.integers(1, length // 2)):] = 1
    return ids


def packed_segments(rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
    """Segment ids [rows, length]: texts of random lengths (1, 2, ...) then a padding tail (0)."""
    ids = np.zeros((rows, length), np.int32)
    for r in range(rows):
        end = length - int(rng.integers(length // 16, length // 4 + 1))
        pos, seg = 0, 1
        while pos < end:
            n = min(int(rng.integers(max(4, length // 16), max(5, length // 3))), end - pos)
            ids[r, pos:pos + n] = seg
            pos, seg = pos + n, seg + 1
    return ids


def _timed(f, args, repeats: int) -> float:
    """Median seconds of `repeats` calls of `f` (called once already: compiled and warm)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def attention_impls() -> list[str]:
    """The platform's candidates, "xla" and "explicit"; on CPU the GPU and TPU kernels in interpret mode too."""
    name = kernels.platform()
    impls = list(attention.CANDIDATES.get(name, ()))
    if name == "cpu":
        impls += ["pallas", "splash"]
    return impls + ["xla", "explicit"]


def attention_cases(reduced: bool, rng: np.random.Generator):
    """(family, layout, heads, kv heads, head size, causal, window, segment ids, texts-per-row bound) of the
    section: every family on packed rows, and the decoders on left-padded rows of one text each."""
    rows, length = REDUCED_ROWS if reduced else FULL_ROWS
    for family, (heads, kv, dim, causal, window) in SHAPES.items():
        if reduced and family in REDUCED_SAME:
            continue
        if reduced:
            heads, kv = REDUCED_HEADS[family]
            window = REDUCED_WINDOW if window is not None else None
        seg = packed_segments(rng, rows, length)
        yield family, "packed", heads, kv, dim, causal, window, seg, packing.segment_bound(int(seg.max()))
        if causal and not (reduced and family != "qwen2"):        # the reduced form: one decoder is enough
            yield family, "left-padded", heads, kv, dim, causal, window, left_padded_segments(rng, rows, length), 1


def attention_section(reduced: bool, repeats: int, budget: Budget | None = None) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    where = kernels.platform()
    for family, layout, heads, kv, dim, causal, window, seg_np, bound in attention_cases(reduced, rng):
        refused = budget.refuse(EXPECTED_S["attention"]) if budget else None
        if refused:
            out.append({"family": family, "layout": layout, "skipped": refused, "ok": None})
            continue
        rows, length = seg_np.shape
        seg = jnp.asarray(seg_np)
        real = seg_np > 0
        q32, k32, v32 = (jnp.asarray(rng.standard_normal((rows, length, n, dim)), jnp.float32) for n in (heads, kv, kv))
        # the cotangent of training: none at padding (pooling never reads it); a kernel must then give padding
        # tokens an exact 0 gradient (cuDNN leaves the gradients of tokens outside every sequence unwritten)
        ct = jnp.asarray(rng.standard_normal((rows, length, heads, dim)) * real[:, :, None, None], jnp.float32)

        # segment ids and cotangent are arguments of the jitted functions, not constants they close over: XLA
        # would fold tens of MB of constants into every program (seconds each at the full form's shapes)
        def fwd_bwd(impl, q, k, v, seg, ct):
            def loss(q, k, v):
                with attention.options(max_segments=bound):          # the bound a batch of this layout carries
                    o = attention.attention(q, k, v, seg, causal=causal, window=window, impl=impl)
                return jnp.sum(o.astype(jnp.float32) * ct), o
            (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
            return o, grads

        for dtype in (jnp.float32, jnp.bfloat16):
            q, k, v = (x.astype(dtype) for x in (q32, k32, v32))
            # the reference: explicit in float32 at the highest precision on the very (rounded) inputs
            with jax.default_matmul_precision("highest"):
                ref_o, ref_g = jax.jit(functools.partial(fwd_bwd, "explicit"))(
                    *(x.astype(jnp.float32) for x in (q, k, v)), seg, ct)
            refs = {"out": ref_o, "dq": ref_g[0], "dk": ref_g[1], "dv": ref_g[2]}
            # measured once per implementation that runs: a request that falls back reuses its figures
            measured = {}
            for impl in attention_impls():
                row = {"family": family, "layout": layout, "dtype": jnp.dtype(dtype).name, "rows": rows,
                       "length": length, "heads": heads, "kv_heads": kv, "head_dim": dim, "causal": causal,
                       "window": window, "max_segments": bound, "texts": int(seg_np.max(axis=1).sum()),
                       "real_tokens": int(real.sum()), "asked": impl}
                try:
                    choice = attention.choose(q, k, causal=causal, window=window, impl=impl)
                    row.update(chosen=choice.impl, reason=choice.reason)
                    if choice.impl not in measured:
                        f = jax.jit(functools.partial(fwd_bwd, choice.impl))
                        t0 = time.perf_counter()
                        o, g = jax.block_until_ready(f(q, k, v, seg, ct))
                        first = time.perf_counter() - t0
                        got = {"out": o, "dq": g[0], "dk": g[1], "dv": g[2]}
                        diffs, rel = {}, {}
                        for name, r in refs.items():
                            d = np.abs(np.asarray(got[name], np.float32) - np.asarray(r))[real]
                            scale = float(np.abs(np.asarray(r)[real]).max())
                            diffs[name] = float(d.max())
                            rel[name] = float(d.max()) / max(scale, 1e-30)
                        padding = [np.asarray(x, np.float32)[~real] for x in g]
                        pad_grad = max((float(np.abs(x).max()) if x.size else 0.0) for x in padding)
                        median = _timed(f, (q, k, v, seg, ct), repeats)
                        tol = tolerance(row["dtype"], where)
                        measured[choice.impl] = dict(
                            max_abs_diff=diffs, max_rel_diff=rel, tolerance=tol, padding_grad_max=pad_grad,
                            compile_s=first, fwd_bwd_ms=median * 1e3,
                            ok=bool(all(np.isfinite(x) and x <= tol for x in rel.values()) and pad_grad == 0.0))
                    row.update(measured[choice.impl])
                except Exception as e:     # noqa: BLE001 - one implementation's failure is a result, not the end
                    row.update(_error(e), ok=False)
                out.append(row)
    return out


# ----------------------------------------------------------------------------------------------- runs

def random_params(abstract, shardings, seed: int = 0):
    """Parameters of the tree `abstract` drawn on the devices: norm scales 1, biases 0, the rest N(0, 0.02^2)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def draw(key):
        keys = jax.random.split(key, len(paths))
        out = []
        for kk, (path, x) in zip(keys, paths):
            last = str(getattr(path[-1], "key", path[-1]))
            if last == "scale":
                out.append(jnp.ones(x.shape, x.dtype))
            elif last == "bias":
                out.append(jnp.zeros(x.shape, x.dtype))
            else:
                out.append((0.02 * jax.random.normal(kk, x.shape, jnp.float32)).astype(x.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    return jax.jit(draw, out_shardings=shardings)(jax.random.key(seed))


def run_config(folder: str, dtype: str, query_max_len: int, passage_max_len: int, batch_size: int, steps: int,
               decoder: bool, learning_rate: float = 5e-5, remat: str = "full"):
    c = config_lib.base_config("uni_p")
    overrides = {"model.checkpoint": folder, "model.dtype": dtype, "data.query_max_len": query_max_len,
                 "data.passage_max_len": passage_max_len, "train.batch_size": batch_size, "train.steps": steps,
                 "train.learning_rate": learning_rate, "eval.synthetic": False, "eval.canary": ""}
    if decoder:
        overrides.update({"model.pooling": "last", "model.remat": remat, "model.scan_layers": True})
    return config_lib.override(c, overrides)


class Run:
    """bench train's Setup (the run's real step, batches and mesh) with random weights on the devices."""

    def __init__(self, config, records, params=None, keep: bool = False):
        """Set up the run with random weights, or with the `params` of another Run of the same model.

        `params`: drawn for another Run of the same model (params are float32 whatever model.dtype is); copied, since
        the state takes its parameters' buffers (donated). `keep`: keep a copy of the initial parameters as `initial`,
        for another Run."""
        self.setup = bench_train.Setup(config, records, weights=False)
        fresh = params is None
        if fresh:
            params = random_params(self.setup.params, self.setup.shardings.params, config.train.seed)
        self.state, _ = state_lib.create_sharded_state(params if fresh else jax.tree.map(jnp.copy, params),
                                                       self.setup.optimizer, config.train.seed,
                                                       self.setup.encoder.module, self.setup.mesh)
        self.initial = (jax.tree.map(jnp.copy, self.state.params) if fresh else params) if keep else None

    def batches(self, n: int) -> list:
        return [self.setup.batch(i) for i in range(n)]


class _Choices(logging.Handler):
    """Collects the attention choices logged by `attention.attention` while tracing."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message not in self.messages:
            self.messages.append(message)


@contextlib.contextmanager
def captured_choices():
    handler, log = _Choices(), logging.getLogger(attention.__name__)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    attention._REPORTED.clear()          # each distinct choice is logged once per process: log it again here
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


# ----------------------------------------------------------------------------------------------- numerics

def numerics_section(reduced: bool, root: str) -> dict:
    if reduced:
        steps, hidden, inter, layers, batch, lens = 5, 64, 128, 2, 4, (32, 64)
    else:
        steps, hidden, inter, layers, batch, lens = 30, 128, 256, 3, 8, (64, 128)
    models = {"bert": _tiny(shapes.BERT_BASE, hidden, layers, 4, None, inter),
              "qwen2": _tiny(shapes.QWEN25_15B, hidden, layers, 4, 2, inter)}
    records = shapes.inf_ir_shaped_records(batch * steps, seed=1)
    out = {"steps": steps, "rows_per_step": 3 * batch, "max_len": list(lens),
           "tolerance": {"relative": NUMERICS_REL, "absolute": NUMERICS_ABS}}
    for name, hf_config in models.items():
        try:
            folder = shapes.checkpoint_folder(hf_config, root)
            curves, skipped, params = {}, {}, None
            for dtype in ("float32", "bfloat16"):
                config = run_config(folder, dtype, *lens, batch, steps, name == "qwen2", learning_rate=1e-4)
                config.data.pack_shapes = 1        # one compiled step per run
                run = Run(config, records, params, keep=True)
                params = run.initial           # the bf16 run starts from the very same parameters
                state, losses = run.state, []
                # one batch, every step: its loss must fall (over different batches it wanders with them)
                for b in run.batches(1) * steps:
                    state, metrics = run.setup.step(state, b)
                    losses.append(float(metrics["loss"]))
                curves[dtype] = losses
                skipped[dtype] = int(state.skipped)
            # `params`: the float32 parameters both runs started from
            grads = numerics_gradients(run_config(folder, "float32", *lens, batch, steps, name == "qwen2"), records,
                                       params)
            f32, bf16 = np.asarray(curves["float32"]), np.asarray(curves["bfloat16"])
            diff = np.abs(bf16 - f32)
            finite = bool(np.isfinite(f32).all() and np.isfinite(bf16).all())
            out[name] = {"hf_config": {k: hf_config[k] for k in ("hidden_size", "num_hidden_layers",
                                                                  "num_attention_heads", "intermediate_size")},
                         "loss_float32": curves["float32"], "loss_bfloat16": curves["bfloat16"],
                         "skipped_steps": skipped, "finite": finite,
                         "max_abs_diff": float(diff.max()), "max_rel_diff": float((diff / np.abs(f32)).max()),
                         "losses_passed": finite and bool((diff <= np.maximum(NUMERICS_REL * np.abs(f32),
                                                                             NUMERICS_ABS)).all())
                         and not any(skipped.values()),
                         "gradients": grads}
            out[name]["passed"] = out[name]["losses_passed"] and grads["passed"]
        except Exception as e:    # noqa: BLE001
            traceback.print_exc()
            out[name] = dict(_error(e), passed=False)
    out["passed"] = all(out[m].get("passed", False) for m in models)
    return out


def numerics_gradients(config, records: list[dict], params) -> dict:
    """Every parameter's bf16 gradient against float32 on the run's first batch (benchmarks/gradients.py): the
    worst leaves, and whether each is within NUMERICS_GRAD_TOLERANCE."""
    result = gradients.compare(config, records, params, tolerance=NUMERICS_GRAD_TOLERANCE)
    return {"passed": bool(result["passed"]), "tolerance": result["tolerance"], "leaves": len(result["leaves"]),
            "loss": result["loss"], "worst": [e.as_dict() for e in result["leaves"][:NUMERICS_WORST]]}


# ----------------------------------------------------------------------------------------------- scale

SCALE_MODELS = {"bert-base": (shapes.BERT_BASE, False), "qwen2.5-1.5b": (shapes.QWEN25_15B, True)}
SCALE_LENS = (256, 512)
SCALE_BATCH = 32          # the paper's records per batch; 3 rows each with hard negatives
SCALE_WARMUP, SCALE_STEPS = 2, 8
PROFILE_STEPS = 3         # --profile: steady steps traced per shape


def _peak_memory() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def scale_one(hf_config: dict, decoder: bool, root: str, profile: bool = False) -> tuple[dict, list]:
    """(figures, the rows of each step as [queries, passages]) of one shape; with `profile`, a trace of
    PROFILE_STEPS more steps summarised by kernel (benchmarks/profile.py)."""
    folder = shapes.checkpoint_folder(hf_config, root)
    n = SCALE_WARMUP + SCALE_STEPS
    config = run_config(folder, "bfloat16", *SCALE_LENS, SCALE_BATCH, n, decoder, remat="auto")   # as the presets
    records = shapes.inf_ir_shaped_records(max(4 * SCALE_BATCH * n, 256))
    with captured_choices() as choices:
        run = Run(config, records)
        batches = run.batches(n)
        t0 = time.perf_counter()
        compiled = {}
        for b in batches:
            if bench_train._shape(b) not in compiled:
                compiled[bench_train._shape(b)] = run.setup.compile(b)
        compile_s = time.perf_counter() - t0
    # every compiled shape runs once before the timing (a shape's first run loads it and allocates)
    state = bench_train.warm_up(compiled, run.state, batches, SCALE_WARMUP)
    times = []
    for b in batches[SCALE_WARMUP:]:
        t0 = time.perf_counter()
        state, metrics = compiled[bench_train._shape(b)](state, b)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    trace = None
    if profile:                          # a profiler that cannot run (no CUPTI) costs the profile, not the figures
        try:
            with tempfile.TemporaryDirectory(prefix="infjax_trace_", dir=root) as folder:
                state, trace = profile_lib.profile_steps(compiled, state, batches[SCALE_WARMUP:][:PROFILE_STEPS],
                                                         folder, shape=bench_train._shape)
        except Exception as e:   # noqa: BLE001
            traceback.print_exc()
            trace = _error(e)
    timed = batches[SCALE_WARMUP:]
    model = run.setup.encoder
    flops = float(np.mean([flops_lib.step_flops(query_params(run.setup.params), model.module.config,
                                                flops_lib.text_lengths(jax.device_get(b)),
                                                frozen_base=model.lora is not None).total
                           for b in timed])) / jax.device_count()
    compiled_flops = float(np.mean([bench_train.flops_of(compiled[bench_train._shape(b)]) for b in timed]))
    real = float(np.mean([real_tokens(jax.device_get(b)) for b in timed]))
    peak = bench_train.peak_flops(jax.devices()[0])
    heads, kv = hf_config["num_attention_heads"], hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])
    dim = hf_config["hidden_size"] // heads
    probe = jax.ShapeDtypeStruct((1, SCALE_LENS[1], heads, dim), jnp.bfloat16)
    probe_k = jax.ShapeDtypeStruct((1, SCALE_LENS[1], kv, dim), jnp.bfloat16)
    rows = run.setup.build.global_rows
    result = {"rows_per_step": rows, "max_len": list(SCALE_LENS), "compile_s": compile_s, "step_s": seconds,
              "step_times": times, "rows_per_s": rows / seconds, "real_tokens_per_s": real / seconds,
              "flops_per_step": flops, "flops": "analytic model FLOPs per device (benchmarks/flops.py)",
              "compiled_flops_per_step": compiled_flops, "mfu": (flops / seconds / peak) if peak and flops else None,
              "compiled_peak_bytes": max(bench_train.peak_bytes(c) for c in compiled.values()),
              "peak_bytes_in_use": _peak_memory(), "loss_last": float(metrics["loss"]),
              "attention_choice": attention.choose(probe, probe_k, causal=decoder).impl,
              "attention_log": choices, "shapes_compiled": len(compiled),
              "remat": run.setup.remat if decoder else "none", "remat_auto": run.setup.remat_line}
    if trace is not None:
        result["profile"] = trace
    build = run.setup.build
    texts = [[build.step_texts.side_texts(i, local=False)[0][s] for s in ("q", "p")] for i in range(n)]
    del run, state, compiled, batches
    return result, texts


# ----------------------------------------------------------------------------------------------- vs torch

TORCH_LOOP = ("HF transformers, sdpa attention, unpacked (each batch padded to its longest text), eager (no "
              "torch.compile), bf16 autocast, AdamW, in-batch softmax")


def torch_status() -> str | None:
    """Why the PyTorch loop cannot run on this device (None: it can), asked in a child process so that this
    one does not hold a CUDA context."""
    code = "import torch, transformers; print(torch.cuda.is_available())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=runtime_cpu.plain_env())
    if p.returncode != 0:
        return f"torch/transformers not importable: {(p.stderr.strip().splitlines() or [''])[-1]}"
    if p.stdout.strip() != "True":
        return "torch has no CUDA device"
    return None


def torch_in_child(texts: list, hf_config: dict, folder: str, decoder: bool) -> dict:
    job = {"steps": texts, "warmup": SCALE_WARMUP, "hf_config": hf_config, "tokenizer": folder,
           "query_max_len": SCALE_LENS[0], "passage_max_len": SCALE_LENS[1], "temperature": 0.05,
           "learning_rate": 5e-5, "decoder": decoder}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        p = subprocess.run([sys.executable, "-m", "infjax.benchmarks.accelerator", "--torch_child", f.name],
                           capture_output=True, text=True, env=runtime_cpu.plain_env())
    finally:
        os.unlink(f.name)
    if p.returncode != 0:
        tail = [x for x in p.stderr.strip().splitlines() if x.strip()]
        return {"error": tail[-1][:500] if tail else f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def torch_child(path: str) -> None:
    """The PyTorch loop on the GPU: HF model (sdpa) from the config, bf16 autocast, dynamic padding, AdamW,
    in-batch softmax of q . p^T / temperature (pooling: mean for encoders, last token for decoders)."""
    import torch
    import transformers

    job = json.load(open(path))
    torch.manual_seed(0)
    cfg = dict(job["hf_config"])
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg, use_cache=False)
    device = job.get("device", "cuda")          # "cpu": a check of this loop where no GPU is at hand
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = transformers.AutoModel.from_config(config, attn_implementation="sdpa").to(device).train()
    if job["decoder"]:
        # as infjax's remat: the activations of 28 layers do not fit (transformers 5 renamed the method)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    tok = transformers.AutoTokenizer.from_pretrained(job["tokenizer"])
    tok.padding_side = "left" if job["decoder"] else "right"
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["learning_rate"], weight_decay=0.0)

    def features(texts, max_len):
        return {k: v.to(device) for k, v in tok(texts, padding=True, truncation=True, max_length=max_len,
                                           return_tensors="pt").items() if k in ("input_ids", "attention_mask")}

    def embed(f):
        hidden = model(**f).last_hidden_state
        if job["decoder"]:
            pooled = hidden[:, -1]
        else:
            m = f["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(pooled.float(), dim=-1)

    batches = [(features(q, job["query_max_len"]), features(p, job["passage_max_len"])) for q, p in job["steps"]]
    times = []
    for q, p in batches:
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            eq, ep = embed(q), embed(p)
        logits = eq @ ep.T / job["temperature"]
        labels = torch.arange(len(eq), device=logits.device) * (len(ep) // len(eq))
        loss = torch.nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        sync()
        times.append(time.perf_counter() - t0)
    timed = times[job["warmup"]:]
    print(json.dumps({"step_s": float(np.median(timed)), "step_times": timed,
                      "peak_bytes": int(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
                      "torch": torch.__version__,
                      "loss_last": loss.item()}))


# ----------------------------------------------------------------------------------------------- main

def _attention_lines(att) -> list[str]:
    if isinstance(att, dict):
        return [f"attention: {att.get('error', att.get('skipped'))}"]
    lines = [f"{'family':<18} {'layout':<11} {'dtype':<9} {'asked':<9} {'chosen':<9} {'out':>8} {'dq':>8} "
             f"{'dk':>8} {'dv':>8} {'pad':>7} {'ms':>9}  ok"]
    for r in att:
        if "skipped" in r:
            lines.append(f"{r['family']:<18} {r.get('layout', '-'):<11} {r['skipped']}")
            continue
        head = f"{r['family']:<18} {r.get('layout', '-'):<11} {r['dtype']:<9} {r['asked']:<9} "
        if "error" in r:
            lines.append(head + f"{r.get('chosen', '-'):<9} {r['error']}")
            continue
        d = r["max_rel_diff"]
        lines.append(head + f"{r['chosen']:<9} " + " ".join(f"{d[k]:8.1e}" for k in ("out", "dq", "dk", "dv"))
                     + f" {r['padding_grad_max']:7.1e} {r['fwd_bwd_ms']:9.2f}  {'ok' if r['ok'] else 'FAIL'}")
    lines.append("(max |impl - explicit f32 at highest precision| / max |explicit| on real tokens; pad: largest "
                 "q/k/v gradient at padding, must be 0; ms: forward+backward, median)")
    return lines


def _numerics_lines(num: dict) -> list[str]:
    lines = []
    for name in ("bert", "qwen2"):
        e = num.get(name, {})
        if "error" in e or "error" in num:
            lines.append(f"numerics {name}: {e.get('error', num.get('error'))}")
        elif e:
            g = e["gradients"]
            worst = g["worst"][0] if g["worst"] else {"relative": 0.0, "path": "-"}
            lines.append(f"numerics {name}: {num['steps']} steps, loss f32 {e['loss_float32'][0]:.4f} -> "
                         f"{e['loss_float32'][-1]:.4f}, bf16 {e['loss_bfloat16'][0]:.4f} -> {e['loss_bfloat16'][-1]:.4f}, "
                         f"max rel diff {e['max_rel_diff']:.2e}; gradients of {g['leaves']} leaves, the worst "
                         f"{worst['relative']:.2e} ({worst['path']}, tolerance {g['tolerance']}): "
                         f"{'passed' if e['passed'] else 'FAILED'}")
    return lines


def _scale_lines(sections: dict) -> list[str]:
    lines = []
    for section in ("scale", "vs_torch"):
        s = sections.get(section, {})
        if "skipped" in s or "error" in s:
            lines.append(f"{section}: {s.get('skipped', s.get('error'))}")
            continue
        for name, r in s.items():
            if not isinstance(r, dict):
                continue
            if "error" in r or "skipped" in r:
                lines.append(f"{section} {name}: {r.get('error', r.get('skipped'))}")
            elif section == "scale":
                mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}% (analytic)"
                peak = r["peak_bytes_in_use"] or r["compiled_peak_bytes"]
                lines.append(f"scale {name}: step {r['step_s'] * 1e3:.0f} ms, {r['rows_per_s']:.0f} rows/s, "
                             f"{r['real_tokens_per_s']:.0f} real tokens/s, MFU {mfu}, peak {peak / 2**30:.1f} GiB, "
                             f"attention {r['attention_choice']}, remat {r.get('remat', 'n/a')}")
                if r.get("remat_auto"):
                    lines.append(f"scale {name}: {r['remat_auto']}")
                if "profile" in r and "error" in r["profile"]:
                    lines.append(f"scale {name}: profile: {r['profile']['error']}")
                elif "profile" in r:
                    lines.append(f"scale {name}: the {profile_lib.TOP} kernels that take the most time per step")
                    lines.append(profile_lib.table(r["profile"]))
            else:
                lines.append(f"vs_torch {name}: infjax {r['infjax_rows_per_s']:.0f} rows/s, torch "
                             f"{r['torch_rows_per_s']:.0f} rows/s, ratio {r['ratio']:.2f}x (torch: {TORCH_LOOP})")
    return lines


def _table(report: dict) -> str:
    sections, lines = report["sections"], []
    for name in report["order"]:
        if name == "numerics":
            lines += _numerics_lines(sections["numerics"])
        elif name == "scale":
            lines += _scale_lines(sections)
        else:
            lines += _attention_lines(sections["attention"])
    times = ", ".join(f"{k} {v:.1f} s" for k, v in report.get("section_s", {}).items())
    lines.append(f"total {report['wall_s']:.1f} s ({times}); report: {report['out']}")
    return "\n".join(lines)


SECTIONS = ("numerics", "scale", "attention")      # in the order they run: the most telling first


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", "accelerator.json", "the JSON report (written again after each section)",
                        flag_values=fv)
    flags.DEFINE_bool("reduced", False, "tiny shapes only (the form that runs on a CPU)", flag_values=fv)
    flags.DEFINE_list("sections", list(SECTIONS), f"the sections to run, comma-separated, from {', '.join(SECTIONS)} "
                      "(they run in that order; scale includes the PyTorch loop)", flag_values=fv)
    flags.DEFINE_float("budget_s", BUDGET_S, "full form: a case of scale or attention starts only if the time it "
                       "takes is left of this many seconds (else it is recorded as skipped); 0 = no limit",
                       flag_values=fv)
    flags.DEFINE_bool("profile", False, f"scale: trace {PROFILE_STEPS} steady steps of each shape with jax.profiler "
                      f"and report the {profile_lib.TOP} kernels that take the most time", flag_values=fv)


def _args(argv: list[str]):
    fv = cli.parse("python -m infjax.bench accelerator", define_flags, argv, doc=__doc__.split("\n\n")[0])
    unknown = [x for x in fv.sections if x not in SECTIONS]
    if unknown or not fv.sections:
        raise errors.UserError(f"--sections={','.join(fv.sections)}: choose from {', '.join(SECTIONS)}")
    return fv


def writable_file(path: str, flag: str) -> str:
    """`path` as an absolute path where a file can be written, or a UserError naming `flag` (checked before any
    work: a report that cannot be written is found now, not after the measurements)."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise errors.UserError(f"{flag}={path}: is a folder; name a file, e.g. {os.path.join(path, 'accelerator.json')}")
    folder = os.path.dirname(full)
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise errors.UserError(f"{flag}={path}: cannot write in {existing}")
    return full


def write_report(report: dict, path: str) -> None:
    """The report as it stands, replacing the file whole (a kill between sections leaves the previous one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(partial, path)


def main(argv: list[str]) -> None:
    fv = _args(argv)
    out_path, reduced = writable_file(fv.out, "--out"), fv.reduced
    wanted = [name for name in SECTIONS if name in fv.sections]
    if fv.budget_s < 0:
        raise errors.UserError(f"--budget_s={fv.budget_s:g}: seconds >= 0 (0 = no limit)")
    budget = Budget(fv.budget_s)
    t_start = time.perf_counter()
    accelerator_expected = not runtime_cpu.runs_on_cpu(os.environ)
    torch_reason = None
    if accelerator_expected and not reduced and "scale" in wanted:
        torch_reason = torch_status()
        if torch_reason is None:            # before JAX starts: leave the torch child half of the device
            os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    on_accelerator = kernels.platform() != "cpu"
    reduced = reduced or not on_accelerator
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "jax": jax.__version__, "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
              "device": platform.describe(), "platform": kernels.platform(),
              "form": "reduced" if reduced else "full", "order": wanted,
              "jax_memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
              "tokenizer": shapes.tokenizer_source(), "sections": {}, "section_s": {}, "out": out_path}
    sections = report["sections"]
    print(f"infjax accelerator check: {report['device']}, {report['form']} form, sections {', '.join(wanted)}")
    root = tempfile.mkdtemp(prefix="infjax_accelerator_")
    try:
        for name in wanted:
            t0 = time.perf_counter()
            if name == "numerics":
                try:
                    sections["numerics"] = numerics_section(reduced, root)
                except Exception as e:   # noqa: BLE001
                    traceback.print_exc()
                    sections["numerics"] = dict(_error(e), passed=False)
            elif name == "scale":
                if not on_accelerator or reduced:
                    why = "no accelerator" if not on_accelerator else "reduced form"
                    sections["scale"], sections["vs_torch"] = {"skipped": why}, {"skipped": why}
                else:
                    scale_and_torch(sections, root, torch_reason, fv.profile, budget)
            else:
                try:
                    sections["attention"] = attention_section(reduced, repeats=1 if reduced else 5,
                                                              budget=None if reduced else budget)
                except Exception as e:   # noqa: BLE001
                    traceback.print_exc()
                    sections["attention"] = _error(e)
            report["section_s"][name] = time.perf_counter() - t0
            report["wall_s"] = time.perf_counter() - t_start
            write_report(report, out_path)        # after each section: what was measured is kept
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - t_start
    print(_table(report))                  # first: the figures are seen whatever happens to the file
    write_report(report, out_path)


def scale_and_torch(sections: dict, root: str, torch_reason: str | None, profile: bool = False,
                    budget: Budget | None = None) -> None:
    scale, vs = {}, ({"skipped": torch_reason} if torch_reason else {})
    sections["scale"], sections["vs_torch"] = scale, vs
    budget = budget or Budget(0)
    for name, (hf_config, decoder) in SCALE_MODELS.items():
        texts = None
        refused = budget.refuse(EXPECTED_S["scale_decoder" if decoder else "scale"])
        if refused:
            scale[name] = {"skipped": refused}
            if not torch_reason:
                vs[name] = {"skipped": refused}
            continue
        try:
            scale[name], texts = scale_one(hf_config, decoder, root, profile)
        except Exception as e:   # noqa: BLE001 - e.g. out of memory: record the line and go on
            traceback.print_exc()
            scale[name] = _error(e)
        jax.clear_caches()
        if torch_reason:
            continue
        if texts is None:
            vs[name] = {"skipped": "the infjax run of this shape failed"}
            continue
        refused = budget.refuse(EXPECTED_S["torch"])
        if refused:
            vs[name] = {"skipped": refused}
            continue
        try:
            t = torch_in_child(texts, hf_config, shapes.checkpoint_folder(hf_config, root), decoder)
            if "error" in t:
                vs[name] = t
                continue
            mine = scale[name]["rows_per_s"]
            theirs = scale[name]["rows_per_step"] / t["step_s"]      # the same rows per step
            vs[name] = {"infjax_rows_per_s": mine, "torch_rows_per_s": theirs, "ratio": mine / theirs, "torch": t,
                        "torch_loop": TORCH_LOOP}
        except Exception as e:   # noqa: BLE001
            traceback.print_exc()
            vs[name] = _error(e)


def _jaxlib_version() -> str | None:
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:   # noqa: BLE001
        return None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--torch_child":
        torch_child(sys.argv[2])
