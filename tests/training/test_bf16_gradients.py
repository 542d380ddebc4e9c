"""bf16 computes, float32 sums (models/precision.py), checked on the train step of every family.

Two checks, on the default config (multi_pi, synthetic data, 32 records with hard negatives) with a tiny random
checkpoint of each family (BERT, ModernBERT, Llama, Qwen2; numpy-made, so both CI legs run them):

- the bf16 train step as JAX lowers it (the program every platform's compiler is given) takes no sum in bf16:
  no scatter-add into an embedding table, no bias, norm-scale or shared key/value head reduction in bf16. XLA:CPU
  happens to run some of those in float32 after all (it widens bf16 scatters), and an accelerator's compiler
  may not: the lowered program is what infjax asks for. The GPU and TPU programs themselves are checked in
  tests/accelerators/.
- one gradient of that step from the same float32 parameters on the same batch, computed in float32 and in
  bf16, leaf by leaf (benchmarks/gradients.py), each family as its preset trains it (the decoders: last-token
  pooling, scanned layers, remat auto): within a tolerance on every leaf and on the median, and (where torch is
  installed) no further from float32 than torch.autocast's gradient through the Hugging Face model on the same
  texts. The shipped checkpoints (MiniLM, SmolLM2-135M) are checked against autocast in the slow suite.
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


# The bf16 step against float32, leaf by leaf, for each family as its preset trains it (the model keys of the
# presets named here: pooling, scanned layers, remat as `auto` resolves on this CPU), on the
# default config's first batch (packed). Two yardsticks:
#
# - torch.autocast, the paper's own setup, through the Hugging Face model on the same texts and parameters
#   (leg 1, where torch is installed): infjax's bf16 error per leaf over autocast's, median over the leaves, at
#   most ANCHOR_MEDIAN, and infjax's worst leaf at most ANCHOR_WORST x autocast's worst. Per leaf the two
#   roundings differ by chance (a leaf is often 1.5x further in one than in the other, either way), so the check
#   is on the median and the worst. Measured (docs/benchmarks.md, bf16 gradients): medians 0.64-1.01, worst
#   leaves 0.4-1.1x autocast's; with the residual stream and activations in bf16 (before), medians 1.24
#   (MiniLM) to 2.84 and worst leaves up to 3.4x.
# - without torch (both legs, and the JAX versions): every leaf within the tolerance of its pooling and the
#   median leaf within MEDIAN_TOLERANCE. Every value bf16 computes is rounded to an 8-bit mantissa (u = 2^-9);
#   a gradient passes through a few dozen roundings, and the loss's temperature (0.05) multiplies the embeddings'
#   rounding by 20. Mean pooling averages a text's tokens: at most 0.6% here, LEAF_TOLERANCE (2.5%). Last-token
#   pooling takes one token's state, and the last layer's value biases (a sum over the batch that nearly
#   cancels) carry its rounding: autocast's own worst leaf on these checkpoints is 10% (Qwen2's v bias, 11%
#   here), so LAST_TOKEN_TOLERANCE is 15%; the median (at most 1.4% here; Llama 2.5% and Qwen2 6.2% with the
#   stream in bf16) is what tells a bf16 stream from this.
#   A leaf whose float32 gradient is zero but for rounding (BERT's key biases: softmax ignores a shift shared by
#   every key) is measured against the largest leaf's norm instead of its own (gradients.NEGLIGIBLE).
PRESET_OF = {"bert": "minilm", "modernbert": "modernbert-base", "llama": "llama-3.2-1b", "qwen2": "qwen2.5-1.5b"}
ANCHOR_MEDIAN, ANCHOR_WORST = 1.15, 1.5
MEDIAN_TOLERANCE = 0.02
LAST_TOKEN_TOLERANCE = 0.15


def preset_model_keys(family: str) -> dict:
    """The model keys of `family`'s preset, but `model.remat=auto` as it resolves on this CPU: `none` (it keeps
    everything here; resolving it compiles four train steps per gradient). What a policy changes in bf16 is
    tests/models/test_remat.py's (test_bf16_policies_differ_from_none_only_by_xla_excess_precision)."""
    keys = {k: v for k, v in config_lib.PRESETS[PRESET_OF[family]].items()
            if k.startswith("model.") and k != "model.checkpoint"}
    return {**keys, "model.remat": "none"} if keys.get("model.remat") == "auto" else keys


@pytest.fixture(scope="module")
def bf16_leaves(checkpoints):
    """{family: gradients.compare of the family as its preset trains it, leaves under HF's names}, computed once
    (both tests below read it)."""
    class Results(dict):
        def __missing__(self, family):
            config = default_config(checkpoints[family], **preset_model_keys(family))
            self[family] = (config, gradients.compare(config, hf_names=True))
            return self[family]
    return Results()


def check_against_float32(result, pooling: str, name: str):
    leaves = result["leaves"]
    median = float(np.median([e.relative for e in leaves]))
    print(f"{name} ({pooling} pooling): loss f32 {result['loss']['float32']:.5f}, bf16 {result['loss']['bfloat16']:.5f}; "
          f"median leaf {median:.2e}; worst leaves (relative error, |g f32|, shape, path):\n{gradients.table(leaves)}")
    assert len(leaves) == len({e.path for e in leaves}) > 10
    assert all(np.isfinite(e.relative) for e in leaves)
    assert any(e.relative > 0 for e in leaves)                   # really two dtypes
    assert leaves[0].relative <= (LAST_TOKEN_TOLERANCE if pooling == "last" else gradients.LEAF_TOLERANCE), \
        gradients.table(leaves)
    assert median <= MEDIAN_TOLERANCE


def check_against_autocast(result, config, name: str):
    anchor = gradients.torch_anchor(config)
    assert anchor["loss"]["float32"] == pytest.approx(result["loss"]["float32"], rel=1e-5)    # the same texts
    assert {e.path for e in anchor["leaves"]} == {e.path for e in result["leaves"]}
    r = gradients.against_anchor(result["leaves"], anchor["leaves"])
    worst, theirs = result["leaves"][0].relative, anchor["leaves"][0].relative
    print(f"{name}: further from float32 than torch.autocast on {r['worse']} of {r['leaves']} leaves; per leaf, "
          f"error over autocast's: median {r['median']:.2f}, largest {r['largest']:.2f}; worst leaf {worst:.2e}, "
          f"autocast's {theirs:.2e}\nautocast's worst leaves:\n{gradients.table(anchor['leaves'])}")
    assert r["median"] <= ANCHOR_MEDIAN
    assert worst <= ANCHOR_WORST * theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_gradients_match_float32_leaf_by_leaf(bf16_leaves, family):
    config, result = bf16_leaves[family]
    check_against_float32(result, config.model.pooling, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_gradients_are_as_close_to_float32_as_torch_autocasts(bf16_leaves, family):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config, result = bf16_leaves[family]
    check_against_autocast(result, config, family)


# The shipped checkpoints, as their presets train them: MiniLM (the embedded default, mean pooling) and SmolLM2-135M
# (a Llama: last-token pooling, scanned layers). Against autocast only: on real weights the rounding
# of a long residual stream and of nearly cancelling sums puts autocast's own median leaf at 1.5% (MiniLM) and
# 2.6% (SmolLM2) and its worst at 5.0% (MiniLM's key biases, zero but for rounding) and 8.7% (SmolLM2's norm
# scales): a fixed tolerance either fails both by noise or passes a 20% error.
@pytest.mark.slow
def test_real_checkpoints_in_bf16_are_as_close_to_float32_as_torch_autocast(request):
    """MiniLM first, wherever MiniLM is (the embedded default); then SmolLM2-135M, or a skip naming its package
    once MiniLM's comparison has passed."""
    pytest.importorskip("transformers")
    config = default_config(config_lib.EMBEDDED)
    check_against_autocast(gradients.compare(config, hf_names=True), config, "all-MiniLM-L6-v2")
    config = default_config(request.getfixturevalue("smollm2"), **preset_model_keys("llama"))
    check_against_autocast(gradients.compare(config, hf_names=True), config, "SmolLM2-135M")
