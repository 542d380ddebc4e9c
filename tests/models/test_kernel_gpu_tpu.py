"""The GPU and TPU attention paths, checked on the CPU.

What runs here: the conversion of segment ids to cuDNN's packed arguments (a pure function, decoded back),
the check that JAX's private cuDNN module still has what infjax calls (fails loudly when it moves), the
choice of implementation and its fallbacks, and TPU splash attention in Pallas interpret mode under
shard_map inside a whole sharded train step on the 8-device CPU mesh. The Pallas GPU kernel has its own
file (test_gpu_flash.py, interpret mode).

What cannot run on a CPU: cuDNN's kernel itself (it exists only on a GPU) and the native GPU (Triton) and
TPU (Mosaic) lowerings of the Pallas kernels. `python -m infjax.bench accelerator` checks those on the
hardware against the explicit path (outputs, gradients, a bf16 training run).
"""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from infjax.models import attention as A
from infjax.models.kernels import gpu, tpu


def _decode(lengths, offsets, t):
    """Segment ids [B, T] (1, 2, ... in order, 0 elsewhere) from cuDNN's packed arguments."""
    lengths, offsets = np.asarray(lengths), np.asarray(offsets)
    out = np.zeros((lengths.shape[0], t), np.int32)
    for b in range(lengths.shape[0]):
        used = offsets[b] >= 0
        assert used[:-1].sum() == (lengths[b] >= 0).sum()               # one offset per segment length
        assert not used[-1]                                             # the extra slot is padding
        assert np.all(used[:-1] == (lengths[b] >= 0))                   # used entries first, then -1
        for s in np.flatnonzero(lengths[b] >= 0):
            assert out[b, offsets[b, s]:offsets[b, s] + lengths[b, s]].sum() == 0     # no overlap
            out[b, offsets[b, s]:offsets[b, s] + lengths[b, s]] = s + 1
    return out


def _renumbered(seg):
    """Segment ids renumbered 1, 2, ... per row in order of appearance (runs of one nonzero id)."""
    seg = np.asarray(seg)
    out = np.zeros_like(seg)
    for b, row in enumerate(seg):
        n, prev = 0, 0
        for i, s in enumerate(row):
            if s and s != prev:
                n += 1
            out[b, i] = n if s else 0
            prev = s
    return out


ROWS = {
    "one segment": [1] * 8,
    "packed, padding tail": [1, 1, 1, 2, 2, 3, 0, 0],
    "left padding": [0, 0, 0, 1, 1, 1, 1, 1],
    "the maximum number of segments": [1, 2, 3, 4, 5, 6, 7, 8],
    "padding only": [0] * 8,
    "adjacent texts with ids reused": [1, 1, 2, 2, 1, 1, 2, 0],
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_packed_arguments_decode_back_to_the_segments(name):
    seg = jnp.asarray([ROWS[name]], jnp.int32)
    lengths, offsets = gpu.packed_arguments(seg, max_segments=8)
    assert lengths.shape == (1, 8) and offsets.shape == (1, 9)
    assert lengths.dtype == offsets.dtype == jnp.int32
    np.testing.assert_array_equal(_decode(lengths, offsets, 8), _renumbered(seg))


def test_packed_arguments_of_every_row_of_a_sharded_batch_equal_the_unsharded_ones():
    """The conversion runs per row: rows split over the 8-device mesh (the last row of each shard included)
    give the same arguments as the whole batch on one device, and decode back."""
    rng = np.random.default_rng(0)
    seg = np.zeros((16, 32), np.int32)
    for row in seg:
        at, n = 0, 0
        while at < 32 and rng.random() < 0.85:
            length = int(rng.integers(1, 9))
            n += 1
            row[at:at + length] = n
            at += length
    mesh = jax.make_mesh((8,), ("data",))
    sharded = jax.device_put(jnp.asarray(seg), NamedSharding(mesh, P("data")))
    got = jax.jit(lambda s: gpu.packed_arguments(s, 32))(sharded)
    want = gpu.packed_arguments(jnp.asarray(seg), 32)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(_decode(*got, 32), _renumbered(seg))


def test_the_private_cudnn_module_still_has_what_infjax_calls():
    """jax._src.cudnn.fused_attention_stablehlo is private: if a JAX release moves or changes it, this fails
    (at run time the GPU choice then falls back to the Pallas kernel with a warning naming why)."""
    assert gpu.cudnn_api_error() is None, gpu.cudnn_api_error()


def test_on_cpu_the_accelerator_paths_fall_back_to_explicit_saying_why(caplog):
    q = jax.ShapeDtypeStruct((2, 100, 4, 32), jnp.bfloat16)
    impl, reason = A.choose(q, q, impl="cudnn")
    assert impl == "explicit" and reason == "cudnn: no GPU"
    impl, reason = A.choose(q, q, impl="splash")
    assert impl == "explicit" and "row length 100 is not a multiple of splash's block of 128" in reason
    impl, reason = A.choose(q, q, causal=True, window=4, impl="cudnn")
    assert impl == "explicit"
    two_sided = A.choose(q, q, window=4, impl="cudnn") if gpu.on_gpu() else None
    assert two_sided is None
    assert A.choose(q, q, dropout=True, impl="pallas") == ("explicit", "attention dropout is on")
    f32 = jax.ShapeDtypeStruct((2, 128, 4, 32), jnp.float32)
    assert A.choose(f32, f32, impl="pallas") == ("pallas", "asked for")      # interpret mode off a GPU
    assert A.choose(f32, f32, impl="splash") == ("splash", "asked for")
    # a fallback is logged once, as a warning when it was asked for
    x = jnp.zeros((2, 100, 4, 32), jnp.float32)
    seg = jnp.ones((2, 100), jnp.int32)
    A._REPORTED.clear()
    A._WARNED.clear()
    y = jnp.zeros((2, 36, 4, 32), jnp.float32)                       # another shape, the same reason
    with caplog.at_level(logging.INFO, logger=A.log.name):
        A.attention(x, x, x, seg, impl="splash")
        A.attention(x, x, x, seg, impl="splash")
        A.attention(y, y, y, seg[:, :36], impl="splash")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "attention: explicit for rows of 100 tokens" in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert [m for m in infos if "rows of 36 tokens" in m and "not a multiple of splash's block" in m]


def test_row_multiples_follow_the_kernel_that_runs(monkeypatch):
    assert A.row_multiple(32, jnp.float32) is None                 # the CPU kernel takes any length
    monkeypatch.setenv(A.ENV, "splash")
    assert A.row_multiple(32, jnp.float32) == tpu.ROW_MULTIPLE == 128
    assert not A.costs_per_text(32, jnp.float32)                    # splash computes whole rows
    monkeypatch.setenv(A.ENV, "pallas")
    assert A.row_multiple(32, jnp.float32) == gpu.ROW_MULTIPLE and A.costs_per_text(32, jnp.float32)


def _sharded_step_parts(impl, monkeypatch):
    """Loss and parameter gradients of MiniLM's multi_pi objective on one 128-token padded batch, jitted with
    the rows split over the 8-device mesh, attention `impl`."""
    from infjax.data import batches
    from infjax.data.tokenize import TextFormat, Tokenizer
    from infjax.models.encoder import load_encoder
    from infjax.runtime import mesh as mesh_lib
    from infjax.training import embed, setup as setup_lib
    from infjax import losses
    from tests.helpers.configs import small_config

    monkeypatch.setenv(A.ENV, impl)
    config = small_config("multi_pi")
    encoder, params, path = load_encoder(config.model)
    records = setup_lib.load_training_records(config.data)
    plan = batches.BatchPlan(len(records), config.train.batch_size, config.train.seed)
    sampler = batches.InstructionNegativeSampler(records, config.loss.instruction_negatives, config.train.seed)
    build = batches.BatchBuilder(records, plan, Tokenizer(path), TextFormat(), 128, 128, True, sampler)
    mesh = mesh_lib.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    encoder = encoder.with_activation_sharding(mesh_lib.batch_sharding(mesh))
    batch = mesh_lib.put(build(0), mesh_lib.batch_sharding(mesh))
    loss_fn = embed.make_loss_fn(encoder, losses.Objective.from_name(config.objective), False)
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), in_shardings=(mesh_lib.replicated(mesh),
                                                                           mesh_lib.batch_sharding(mesh), None))
    (loss, _), grads = grad(mesh_lib.put(params, mesh_lib.replicated(mesh)), batch, jax.random.key(0))
    text = grad.lower(mesh_lib.put(params, mesh_lib.replicated(mesh)), batch, jax.random.key(0)).as_text()
    return float(loss), jax.device_get(grads), text


@pytest.mark.slow       # ~70 s on 2 cores (two compiles of MiniLM's step, splash interpreted): CI's slow run
def test_splash_under_shard_map_in_a_sharded_train_step_equals_the_explicit_path(monkeypatch):
    q = jax.ShapeDtypeStruct((24, 128, 12, 32), jnp.float32)
    assert A.choose(q, q, impl="splash").impl == "splash"
    loss_splash, grads_splash, text = _sharded_step_parts("splash", monkeypatch)
    assert "shard_map" in text or "sdy.manual_computation" in text          # the kernel ran per device
    loss_ref, grads_ref, _ = _sharded_step_parts("explicit", monkeypatch)
    print(f"splash vs explicit: loss {loss_splash:.7f} vs {loss_ref:.7f}")
    assert loss_splash == pytest.approx(loss_ref, rel=1e-4)
    # Tolerances relative to the largest gradient entry of the model: some leaves (the key biases) have a
    # gradient that is zero in exact arithmetic, and their float32 noise (~1e-10) has no relative precision.
    scale = max(float(np.max(np.abs(b))) for b in jax.tree.leaves(grads_ref))
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(grads_splash),
                                                             jax.tree.leaves(grads_ref)))
    print(f"splash vs explicit: max parameter-gradient difference {worst:.2e} (largest entry {scale:.2e})")
    for a, b in zip(jax.tree.leaves(grads_splash), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale)
