"""infjax's programs compiled for an H100 on this CPU (JAX's compile-only CUDA devices; `.[gpu-compile]`).

A compile runs XLA's whole GPU pipeline for sm_90a (Triton and ptxas for the Pallas kernel): what these tests
check is what an H100 would be given. The train steps of a tiny BERT, Qwen2 (grouped-query heads, remat,
scanned layers) and ModernBERT (a two-sided local window) compile in bfloat16 (BERT and Qwen2 in float32
too), with the attention every layer traced and the kernels that go with it in the compiled program, and
every sum of the program in float32 (no bf16 scatter or reduction: benchmarks/hlo.py); a
left-padded decoder batch reaches cuDNN with its offsets; and (slow) at the paper's batch on BERT-base's width cuDNN's
step needs no more memory than the Pallas kernel's (+5%). What no compile can check (cuDNN's own graph
validation, speed) needs a GPU: `python -m infjax.bench accelerator`.
"""
import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax import config as config_lib
from infjax.benchmarks import compile as bench_compile, shapes as bench_shapes
from infjax.models import attention, kernels
from infjax.models.encoder import load_encoder
from infjax.models.kernels import gpu, gpu_flash
from infjax.runtime import mesh as mesh_lib
from tests.helpers.targets import compile_only_devices, tiny_overrides

CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module")
def h100():
    return compile_only_devices("h100")


def small(family, dtype, root, **extra):
    c = config_lib.base_config("multi_pi")
    return config_lib.override(c, {**tiny_overrides(family, root), "model.dtype": dtype, "train.batch_size": 8,
                                   "train.steps": 2, "data.synthetic.num_train": 32, "data.query_max_len": 64,
                                   "data.passage_max_len": 128, "loss.instruction_negatives": 1,
                                   "eval.synthetic": False, "eval.canary": "", **extra})


@pytest.fixture(scope="module")
def steps(h100, tmp_path_factory):
    """The compiled train step of each (family, dtype), compiled once for the module."""
    target, devices = h100
    root = tmp_path_factory.mktemp("h100_tiny")
    cache = {}

    def get(family, dtype):
        if (family, dtype) not in cache:
            cache[family, dtype] = bench_compile.compile_step(small(family, dtype, root), target, devices=devices)
        return cache[family, dtype]
    return get


def impls(report):
    return {c.choice.impl for c in report.calls}


# float32 takes the Pallas kernel everywhere: ModernBERT's bf16 step already compiles it for its local layers
@pytest.mark.parametrize("family, dtype", [("bert", "bfloat16"), ("qwen2", "bfloat16"), ("modernbert", "bfloat16"),
                                           ("bert", "float32"), ("qwen2", "float32")])
def test_the_train_step_compiles_for_an_h100_with_the_kernels_it_chose(steps, family, dtype):
    r = steps(family, dtype)
    assert r.compiled is not None and r.memory["temporaries"] > 0 and r.fits
    assert r.calls, "no attention call was traced"
    # every sum of the program H100 runs in float32: no bf16 scatter-add (a compare-and-swap loop per element
    # on Hopper) or bf16 reduction of a gradient (models/precision.py), read from the optimized HLO
    assert r.bf16_sums == [], r.bf16_sums
    assert r.kernels["launches"] >= r.kernels["kernels"] > 0
    kinds = set(r.custom_calls)
    if dtype == "float32":                 # cuDNN's attention takes bf16/fp16 only: the Pallas kernel (TF32)
        assert impls(r) == {"pallas"} and TRITON in kinds and not kinds & set(CUDNN)
        assert all("cudnn: cuDNN flash attention takes bfloat16/float16" in c.choice.reason for c in r.calls)
        return
    grouped = family == "qwen2"
    if family == "modernbert":           # global layers: cuDNN; local layers (two-sided window): Pallas
        by_window = {c.window is None: c.choice.impl for c in r.calls}
        assert by_window == {True: "cudnn", False: "pallas"}
        assert set(CUDNN) <= kinds and TRITON in kinds
    elif grouped and gpu.gqa_offsets_error():     # jax < 0.11.1: grouped heads refused on cuDNN
        assert impls(r) == {"pallas"} and TRITON in kinds and not kinds & set(CUDNN)
        assert all(c.choice.degraded and "0.11.1" in c.choice.reason for c in r.calls)
    else:
        assert impls(r) == {"cudnn"} and set(CUDNN) <= kinds and TRITON not in kinds
    packed = [c for c in r.calls if c.choice.impl == "cudnn"]
    assert all(c.max_segments and c.max_segments < c.shape[1] for c in packed)    # the batch's bound, never T


def test_a_left_padded_decoder_batch_reaches_cudnn_with_its_offsets(h100, tmp_path):
    """Padded inference of a decoder (left padding, one text a row, bf16): the lowered cuDNN calls carry the
    sequence offsets (7 operands: q, k, v, two lengths, two offsets), which JAX drops for a single slot."""
    _, devices = h100
    config = small("qwen2", "bfloat16", tmp_path)
    with kernels.targeting(devices[:1]), attention.recorded() as calls:
        encoder, params, _ = load_encoder(config.model, weights=False)
        mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices[:1])
        rows = mesh_lib.batch_sharding(mesh)
        ids = jax.ShapeDtypeStruct((4, 64), jnp.int32, sharding=rows)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=mesh_lib.replicated(mesh)),
                                params)
        if gpu.gqa_offsets_error():       # jax < 0.11.1 keeps grouped heads off cuDNN: make the heads equal
            pytest.skip("grouped heads take the Pallas kernel with this jax; the equal-heads case is below")
        with kernels.lowering():
            lowered = jax.jit(lambda p, i, m: encoder(p["shared"], i, m)).trace(abstract, ids, ids).lower()
        compiled = lowered.compile()
    assert {c.choice.impl for c in calls} == {"cudnn"} and {c.max_segments for c in calls} == {1}
    operands = [len(re.findall(r"%\w+", call)) for call in
                re.findall(r'stablehlo\.custom_call @__cudnn\$fmhaSoftmax\(([^)]*)\)', lowered.as_text())]
    assert operands and set(operands) == {7}, operands
    assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_left_padded_equal_heads_reach_cudnn_with_offsets_on_every_jax(h100):
    """The same for a decoder whose query and kv heads are equal (cuDNN on every jax version)."""
    _, devices = h100
    q = jax.ShapeDtypeStruct((4, 64, 4, 32), jnp.bfloat16)
    seg = np.zeros((4, 64), np.int32)
    seg[:, 20:] = 1                          # left padding: the text ends the row
    with kernels.targeting(devices[:1]):
        assert attention.choose(q, q, causal=True).impl == "cudnn"
        with kernels.lowering():
            lowered = jax.jit(lambda a, s: gpu.cudnn_attention(a, a, a, s, causal=True, max_segments=1)).trace(
                q, jax.ShapeDtypeStruct(seg.shape, jnp.int32)).lower()
        lowered.compile()
    operands = [len(re.findall(r"%\w+", call)) for call in
                re.findall(r'stablehlo\.custom_call @__cudnn\$fmhaSoftmax\(([^)]*)\)', lowered.as_text())]
    assert operands == [7], operands


@pytest.mark.slow        # two train-step compiles for an H100
def test_at_the_paper_bert_base_shape_cudnn_needs_no_more_memory_than_pallas(h100, monkeypatch, tmp_path):
    """BERT-base's width and heads, 2 of its 12 layers (the per-layer memory is the question, and 12 layers
    compile 6 times as long), at the paper's batch: 32 records of InF-IR-shaped texts at 256/512 tokens, bf16.
    `python -m infjax.bench compile --target=h100 --shape=bert-base --paper` gives the 12 layers."""
    target, devices = h100
    config = bench_compile.paper_config(config_lib.base_config("multi_pi"), target, "", str(tmp_path))
    config.model.checkpoint = bench_shapes.checkpoint_folder(dict(bench_shapes.BERT_BASE, num_hidden_layers=2),
                                                             str(tmp_path))
    records = bench_shapes.inf_ir_shaped_records(256)
    temps = {}
    for impl in ("auto", "pallas"):
        monkeypatch.setenv(attention.ENV, impl)
        r = bench_compile.compile_step(config, target, records, devices)
        temps[impl] = r.memory["temporaries"]
        assert impls(r) == {"cudnn" if impl == "auto" else "pallas"}
    print(f"BERT-base width, 2 layers, 256/512, 32 records, bf16, H100: temporaries cuDNN {temps['auto'] / 1e9:.2f} GB, "
          f"Pallas {temps['pallas'] / 1e9:.2f} GB")
    assert temps["auto"] <= 1.05 * temps["pallas"]


def test_offload_keeps_the_saved_activations_in_pinned_host_memory(h100, steps, tmp_path):
    """model.remat=offload compiled for an H100: the values its layers keep wait in pinned host memory (XLA's
    memory space 5, `S(5)` in a layout), which the same step under full (the presets' former policy, which keeps
    only each layer's input) never uses; the device holds what it holds under full, within 1% (measured: +0.03%
    here, 0.0% for Qwen2.5-1.5B and +0.4% for 7B with LoRA at the paper's batch, docs/benchmarks.md)."""
    target, devices = h100
    offload = bench_compile.compile_step(small("qwen2", "bfloat16", tmp_path, **{"model.remat": "offload"}), target,
                                         devices=devices)
    full = steps("qwen2", "bfloat16")
    assert offload.remat == "offload" and full.remat == "full"
    assert "S(5)" in offload.compiled.as_text() and "S(5)" not in full.compiled.as_text()
    assert offload.memory["peak"] <= 1.01 * full.memory["peak"]


def test_jaxs_deprecation_of_the_pallas_triton_backend_is_one_line_per_run(h100, caplog):
    """Where jax deprecates the Pallas Triton backend, JAX warns at every lowering of the Pallas GPU kernel (seen
    here by lowering gpu_flash's kernel alone); lowered through infjax three times, the run gets one line and none
    of JAX's warnings."""
    _, devices = h100
    q = jax.ShapeDtypeStruct((2, 128, 4, 32), jnp.float32)
    seg = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    bounds = jax.ShapeDtypeStruct((2, 128), jnp.int32)

    def lower(fn, *args):
        with kernels.lowering():
            jax.jit(fn).trace(*args).lower()

    deprecated = gpu.triton_status() == "deprecated"
    gpu.note_triton_deprecation.cache_clear()
    with kernels.targeting(devices[:1]):
        with warnings.catch_warnings(record=True) as alone:
            warnings.simplefilter("always")
            lower(lambda a, lo, hi: gpu_flash.flash_attention(a, a, a, lo, hi), q, bounds, bounds)
        with warnings.catch_warnings(record=True) as through_infjax, \
                caplog.at_level(logging.WARNING, logger=gpu.log.name):
            warnings.simplefilter("always")
            for _ in range(3):
                lower(lambda a, s: gpu.flash_attention(a, a, a, s), q, seg)
    gpu.note_triton_deprecation.cache_clear()
    from_jax = lambda seen: [w for w in seen if gpu.TRITON_MESSAGE in str(w.message)]   # noqa: E731
    lines = [r.getMessage() for r in caplog.records if "Pallas Triton backend" in r.getMessage()]
    assert (len(from_jax(alone)) >= 1) == deprecated, [str(w.message) for w in alone]
    assert from_jax(through_infjax) == [] and len(lines) == (1 if deprecated else 0), lines
