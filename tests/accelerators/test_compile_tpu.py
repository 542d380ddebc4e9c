"""infjax's programs compiled for a TPU v5e slice on this CPU (libtpu's compile-only devices; `.[tpu-compile]`).

libtpu's compiler runs in full, Mosaic included: a Pallas TPU kernel that a chip cannot take (VMEM, HBM,
dtypes) is refused here as it would be on the chip, so these compiles check the `interpret=False` side of the
splash kernel that the CPU tests (interpret mode) cannot. The train steps of a tiny BERT, Qwen2 (grouped-query
heads given to splash as they are, remat, scanned layers) and ModernBERT (local and global layers) compile
for 4 chips with splash under shard_map, every sum of the program in float32. The paper's shapes per chip: `python -m infjax.bench compile
--target=v5e-4 --shape=bert-base --paper` (docs/benchmarks.md).
"""
import pytest

from infjax import config as config_lib
from infjax.benchmarks import compile as bench_compile
from tests.helpers.targets import compile_only_devices, tiny_overrides

SPLASH = ("splash_mha_fwd", "splash_mha_dkv", "splash_mha_dq")


@pytest.fixture(scope="module")
def v5e():
    return compile_only_devices("v5e-4")


def splash_kernels(report):
    return {k.split(":", 1)[1] for k in report.custom_calls if k.startswith("tpu_custom_call:")}


@pytest.mark.parametrize("family", ["bert", "qwen2", "modernbert"])
def test_the_train_step_compiles_for_a_v5e_slice_with_splash(v5e, family, tmp_path):
    target, devices = v5e
    config = config_lib.override(config_lib.base_config("multi_pi"), {
        **tiny_overrides(family, tmp_path), "model.dtype": "bfloat16", "train.batch_size": 16, "train.steps": 2,
        "data.synthetic.num_train": 64, "data.query_max_len": 64, "data.passage_max_len": 128,
        "loss.instruction_negatives": 1, "eval.synthetic": False, "eval.canary": ""})
    r = bench_compile.compile_step(config, target, devices=devices)
    assert r.compiled is not None and r.fits and r.memory["temporaries"] > 0
    assert {c.choice.impl for c in r.calls} == {"splash"}
    assert r.bf16_sums == [], r.bf16_sums              # every sum in float32 (models/precision.py)
    assert all(c.shape[1] % 128 == 0 for c in r.calls)                 # rows packed to splash's lanes
    kinds = splash_kernels(r)
    assert all(any(k.startswith(s) for k in kinds) for s in SPLASH), kinds
    if family == "qwen2":                                                # 4 query heads on 2 kv heads, as given
        assert {c.kv_heads for c in r.calls} == {2} and {c.shape[2] for c in r.calls} == {4}
    if family == "modernbert":
        assert {c.window for c in r.calls} == {None, 16}
