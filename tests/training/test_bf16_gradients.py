"""bf16 computes, float32 sums (models/precision.py), checked on the train step of every family.

Two checks, on the default config (multi_pi, synthetic data, 32 records with hard negatives) with a tiny random
checkpoint of each family (BERT, ModernBERT, Llama, Qwen2; numpy-made, so both CI legs run them):

- the bf16 train step as JAX lowers it (the program every platform's compiler is given) takes no sum in bf16:
  no scatter-add into an embedding table, no bias, norm-scale or shared key/value head reduction in bf16. XLA:CPU
  happens to run some of those in float32 after all (it widens bf16 scatters), and an accelerator's compiler
  may not: the lowered program is what infjax asks for. The GPU and TPU programs themselves are checked in
  tests/accelerators/.
- one gradient of that step from the same float32 parameters on the same batch, computed in float32 and in
  bf16, leaf by leaf (benchmarks/gradients.py): each leaf's relative error within `LEAF_TOLERANCE`.
"""
import jax
import numpy as np
import pytest

from infjax import config as config_lib
from infjax.benchmarks import gradients, hlo, train as bench_train
from tests.helpers import tiny

FAMILIES = ("bert", "modernbert", "llama", "qwen2")
# Initialized as Hugging Face initializes these families (initializer_range 0.02), norm gains near 1: the
# activations a pretrained checkpoint has in its first steps, not the saturated softmaxes of larger weights.
INIT_STD = 0.02


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_families")
    return {f: tiny.write_random_checkpoint(f, tiny.FAMILY_CONFIGS[f], str(root / f), std=INIT_STD)
            for f in FAMILIES}


def default_config(folder: str, **overrides):
    """The default config (configs/multi_pi.py's) on `folder`'s checkpoint, without the evaluations, one step
    long (the first batch is the same; the packing plan then measures one step, not the two epochs)."""
    return config_lib.override(config_lib.base_config("multi_pi"), {
        "model.checkpoint": folder, "eval.synthetic": False, "eval.canary": "", "train.steps": 1, **overrides})


def lowered_step_text(config) -> str:
    """The bf16 train step of `config` as JAX lowers it for one device (HLO text, before any compiler pass)."""
    config = config_lib.override(config, {"model.dtype": "bfloat16"})
    setup = bench_train.Setup(config, None, weights=False, devices=jax.devices()[:1])
    return setup.step.lower(*setup.abstract_inputs(setup.abstract_batch(0))).as_text(dialect="hlo")


# The families' presets, and the paths that add their own spreads: LoRA's adapters on a frozen base, Interaction
# II's head over the query's tokens, the decoder presets' scanned and rematerialised layers.
VARIANTS = [(f, {}) for f in FAMILIES] + [
    ("bert", {"model.lora.rank": 4}),
    ("bert", {"model.interaction": "cross_attention"}),
    ("qwen2", {"model.pooling": "last", "model.remat": "full", "model.scan_layers": True}),
]


@pytest.mark.parametrize("family, overrides", VARIANTS, ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k.split('.')[-1]}={x}" for k, x in v.items()) or "default")
def test_no_sum_of_the_bf16_train_step_is_taken_in_bf16(checkpoints, family, overrides):
    text = lowered_step_text(default_config(checkpoints[family], **overrides))
    program = hlo.Program.parse(text)
    assert sum(1 for ins in program.computations[program.entry] if ins.opcode == "parameter") > 0
    sums = [ins for c in program.computations.values() for ins in c if ins.opcode in ("reduce", "scatter")]
    assert any(s.element_type == "f32" for s in sums)          # the sums are there, in float32
    assert hlo.low_precision_sums(text) == []


# The bf16 step against float32, leaf by leaf, within gradients.LEAF_TOLERANCE (2.5%). Every value bf16
# computes is rounded to an 8-bit mantissa (u = 2^-9, 0.2% relative); a gradient passes through a few dozen
# such roundings forward and backward, which add up like a random walk, and the loss's temperature (0.05)
# multiplies the embeddings' rounding by 20 before its softmax. Measured on these checkpoints and this batch,
# with jax 0.10.2 and 0.12.0.1: at most 0.9% (ModernBERT), 1.5% (BERT, Qwen2) and 1.7% (Llama). With the
# sums in bf16 the worst leaves were 2.8% (Llama's norm scales), 4.9% (Qwen2's q biases) and 114% (BERT's
# token-type table), and with jax 0.12's CPU dots also 6.9% (ModernBERT's Wo) (docs/benchmarks.md). A leaf
# whose float32 gradient is zero up to float32 rounding (BERT's key biases: softmax ignores a shift shared by
# every key) is measured against the largest leaf's norm instead of its own (gradients.NEGLIGIBLE).
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_gradients_match_float32_leaf_by_leaf(checkpoints, family):
    result = gradients.compare(default_config(checkpoints[family]))
    leaves = result["leaves"]
    print(f"{family}: loss f32 {result['loss']['float32']:.5f}, bf16 {result['loss']['bfloat16']:.5f}; "
          f"worst leaves (relative error, |g f32|, shape, path):\n{gradients.table(leaves)}")
    assert len(leaves) == len({e.path for e in leaves}) > 10
    assert all(np.isfinite(e.relative) for e in leaves)
    assert any(e.relative > 0 for e in leaves)                   # really two dtypes
    assert leaves[0].relative <= gradients.LEAF_TOLERANCE, gradients.table(leaves)
    assert result["passed"]
