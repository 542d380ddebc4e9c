"""Remat policies (models/remat.py) change what is recomputed, never what is computed; `auto`
(training/remat_choice.py) takes the least recompute whose compiled step fits the device's memory.

On the default config (multi_pi, synthetic data, 32 records with hard negatives) with tiny random checkpoints of
the decoder families as their presets run them (scanned layers, last-token pooling) and of BERT with scanned
layers. `offload` needs pinned host memory (GPU, TPU): its step is compiled for an H100 in tests/accelerators/.
"""
import logging

import jax
import numpy as np
import pytest

from infjax import config as config_lib
from infjax.benchmarks import gradients, train as bench_train
from infjax.errors import ConfigError
from infjax.models import lora, remat
from infjax.training import remat_choice, setup as setup_lib, state as state_lib, step as step_lib
from tests.helpers import tiny

CASES = {"llama": {"model.pooling": "last", "model.scan_layers": True},
         "qwen2": {"model.pooling": "last", "model.scan_layers": True},
         "bert": {"model.scan_layers": True}}


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """{family: bench Setup of the default config on its tiny checkpoint}, each built when first asked for."""
    root = tmp_path_factory.mktemp("remat")

    class Setups(dict):
        def __missing__(self, family):
            folder = tiny.write_random_checkpoint(family, tiny.FAMILY_CONFIGS[family], str(root / family), std=0.02)
            config = config_lib.override(config_lib.base_config("multi_pi"), {
                "model.checkpoint": folder, "eval.synthetic": False, "eval.canary": "", "train.steps": 1,
                **CASES[family]})
            self[family] = bench_train.Setup(config, None, devices=jax.devices()[:1])
            return self[family]
    return Setups()


def _loss_and_grads(setup, policy):
    trainable, frozen = lora.split(setup.params)
    grad_fn = step_lib.make_grad_fn(setup.encoder.with_remat(policy), setup.objective, mesh=setup.mesh)
    (loss, _), grads = jax.jit(grad_fn)(trainable, setup.batch(0), jax.random.key(0), frozen)
    return float(loss), jax.tree.map(np.asarray, grads)


# "To float32 rounding": a policy reorders no sum, it only computes some values twice, so XLA may fuse the
# recomputed copy differently; every leaf within 1e-5 of its norm (measured on this CPU: Llama 0.0, scanned BERT 4.7e-7).
# Leaf by leaf for Llama and scanned BERT in the slow run (~15-20 s a family); Qwen2's every policy is compared
# in the default suite through its whole train step (loss, gradient norm, every updated parameter) below, from
# programs that suite compiles anyway.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_every_policy_gives_the_loss_and_gradients_of_none(setups, family):
    setup = setups[family]
    loss, grads = _loss_and_grads(setup, "none")
    for policy in ("dots", "dots_except_mlp", "full"):
        other_loss, other = _loss_and_grads(setup, policy)
        worst = gradients.leaf_errors(grads, other)[0]
        assert abs(other_loss - loss) <= 1e-6 * abs(loss), (policy, other_loss, loss)
        assert worst.relative <= 1e-5, (policy, worst)


# In bf16 every policy computes the same function, but not with the same roundings: XLA's excess precision (the
# flag xla_allow_excess_precision, on by default) lets a fusion keep a bf16 value in float32 instead of rounding it,
# and a value recomputed in the backward pass is fused differently from one that was kept. With that flag off,
# the bf16 gradient under `full` (the most recompute) equals none's bit for bit; with it on (how runs compile), on
# this CPU `full` moved the tiny Qwen2's gradients by at most 6.2% (its last layer's value bias, a sum over the
# batch that nearly cancels) and the median leaf by 0.9%, `dots` by 4.5% and 0.7% (docs/scale.md, 3.1).
def test_bf16_policies_differ_from_none_only_by_xla_excess_precision(setups):
    import dataclasses

    import jax.numpy as jnp

    setup = setups["qwen2"]
    encoder = dataclasses.replace(setup.encoder, module=setup.encoder.module.clone(dtype=jnp.bfloat16))
    trainable, frozen = lora.split(setup.params)
    args = (trainable, setup.batch(0), jax.random.key(0), frozen)

    def grads(policy, excess):
        grad_fn = step_lib.make_grad_fn(encoder.with_remat(policy), setup.objective, mesh=setup.mesh)
        compiled = jax.jit(grad_fn).lower(*args).compile({"xla_allow_excess_precision": excess})
        return jax.tree.map(np.asarray, compiled(*args)[1])

    for excess in (False, True):
        base = grads("none", excess)
        for policy in ("full",):
            errors = gradients.leaf_errors(base, grads(policy, excess))
            median = float(np.median([e.relative for e in errors]))
            print(f"excess precision {excess}: {policy} against none, worst {errors[0].relative:.2e} "
                  f"({errors[0].path}), median {median:.2e}")
            if not excess:
                assert errors[0].relative == 0.0, (policy, errors[0])
            else:
                assert errors[0].relative <= 0.1 and median <= 0.02, (policy, errors[0], median)


@pytest.fixture(scope="module")
def compiled_qwen(setups):
    """The tiny Qwen2 train step compiled under each policy: {policy: (step, compiled, peak bytes)}."""
    setup = setups["qwen2"]
    example = setup.abstract_inputs(setup.abstract_batch(0))
    out = {}
    for policy in remat.RECOMPUTE_ORDER:
        step = setup.step_for(policy)
        compiled = step.lower(*example).compile()
        out[policy] = (step, compiled, setup_lib.peak_bytes(compiled))
    return out


def test_each_policy_keeps_less_than_the_one_before(compiled_qwen):
    """What a policy keeps is what the compiled step holds: none > dots > dots_except_mlp > full."""
    peaks = [compiled_qwen[p][2] for p in remat.RECOMPUTE_ORDER]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks


def test_auto_takes_the_least_recompute_that_fits_by_the_compiled_memory(compiled_qwen):
    """A fake device memory between two policies' peaks makes `auto` take each policy in turn, compiling from
    full back to the first that does not fit; the line names the peak, the memory and what that one needs.
    Nothing fitting, it takes full and says so."""
    compiled_calls = []

    def compile_policy(policy):
        compiled_calls.append(policy)
        step, compiled, peak = compiled_qwen[policy]
        return remat_choice.Tried(policy, peak, None, step, compiled)

    for i, policy in enumerate(remat.RECOMPUTE_ORDER):
        compiled_calls.clear()
        capacity = int(compiled_qwen[policy][2] / (1 - remat_choice.MARGIN)) + 1
        choice = remat_choice.choose(compile_policy, capacity, agree=lambda index: index)
        assert choice.policy == policy
        assert compiled_calls == list(reversed(remat.RECOMPUTE_ORDER[max(i - 1, 0):]))
        assert choice.line.startswith(f"remat: {policy} (peak {remat_choice.size(compiled_qwen[policy][2])} of "
                                      f"{remat_choice.size(capacity)} less 10%")
        if i > 0:
            before = remat.RECOMPUTE_ORDER[i - 1]
            assert choice.line.endswith(f"; {before} needs {remat_choice.size(compiled_qwen[before][2])})")
    choice = remat_choice.choose(compile_policy, 1000, agree=lambda index: index)
    assert choice.policy == "full" and "no policy fits" in choice.line
    # sizes keep two significant digits: not "peak 0.0 GB of 0.0 GB less 10%: no policy fits"
    assert f"(peak {remat_choice.size(compiled_qwen['full'][2])} of 1.0 kB less 10%" in choice.line
    assert [remat_choice.size(b) for b in (113.5e9, 0.52e9, 917e3, 12)] == ["113.5 GB", "0.52 GB", "0.92 MB", "12 B"]


def test_every_process_takes_the_most_recompute_any_needs(compiled_qwen):
    """Another process that needs `full` where this one fits `none`: this one takes full too (compiled first)."""
    compiled_calls = []

    def compile_policy(policy):
        compiled_calls.append(policy)
        step, compiled, peak = compiled_qwen[policy]
        return remat_choice.Tried(policy, peak, None, step, compiled)

    choice = remat_choice.choose(compile_policy, 10**15, agree=lambda index: len(remat.RECOMPUTE_ORDER) - 1)
    assert choice.policy == "full" and compiled_calls == list(reversed(remat.RECOMPUTE_ORDER))


def test_a_train_step_with_auto_runs_the_program_it_chose(setups, compiled_qwen, caplog):
    """compiled_train_step with model.remat=auto and model.remat_memory_gb between full's and dots_except_mlp's
    peaks: it compiles those two, logs the one line, and runs full's compiled program for the widest batch; every
    policy's compiled train step (compiled_qwen) gives that step's loss, gradient norm and updated parameters."""
    setup = setups["qwen2"]
    gb = compiled_qwen["full"][2] / (1 - remat_choice.MARGIN) / 1e9 * 1.001
    assert compiled_qwen["dots_except_mlp"][2] / 1e9 > gb * (1 - remat_choice.MARGIN)
    config = config_lib.override(setup.config.copy_and_resolve_references(),
                                 {"model.remat": "auto", "model.remat_memory_gb": gb})
    example = setup.abstract_inputs(setup.abstract_batch(0))
    with caplog.at_level(logging.INFO, logger="infjax"):
        step = setup_lib.compiled_train_step(config, setup.encoder, setup.objective, setup.optimizer,
                                             setup.schedule, setup.mesh, setup.shardings, example)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("remat: full (")]
    assert step.policy == "full" and len(lines) == 1 and "dots_except_mlp needs" in lines[0], caplog.text
    assert step.compiled_for(setup.batch(0)) is not None
    state = lambda: state_lib.create_sharded_state(setup.params, setup.optimizer, config.train.seed,  # noqa: E731
                                                   setup.encoder.module, setup.mesh)[0]
    new, metrics = step(state(), setup.batch(0))
    for policy in remat.RECOMPUTE_ORDER:
        other, expected = compiled_qwen[policy][1](state(), setup.batch(0))
        assert float(metrics["loss"]) == float(expected["loss"]), policy
        assert float(metrics["grad_norm"]) == pytest.approx(float(expected["grad_norm"]), rel=1e-6), policy
        for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(other.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7, err_msg=policy)


@pytest.mark.parametrize("value, ok", [("auto", True), ("dots_except_mlp", True), (True, True), ("False", True),
                                       ("dot", False), ("", False), (1, False)])
def test_remat_names_are_checked_in_one_line_listing_the_choices(value, ok):
    config = config_lib.base_config("multi_pi")
    config.model.remat = value if isinstance(value, str) else str(value)
    if ok:
        config_lib.validate(config)
        return
    with pytest.raises(ConfigError) as e:
        config_lib.validate(config)
    assert str(e.value).count("\n") == 0 and "config.model.remat=" in str(e.value)
    assert "none, dots, dots_except_mlp, offload, full, auto" in str(e.value)


def test_offload_where_there_is_no_pinned_host_memory_is_full_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="infjax"):
        assert remat.effective("offload", "cpu") == "full"
    assert len(caplog.records) == 1 and "model.remat=offload" in caplog.records[0].getMessage()
    assert remat.effective("dots", "cpu") == "dots" and remat.effective(True) == "full"

