"""The GPU and TPU attention paths, checked on the CPU.

What runs here: the conversion of segment ids to cuDNN's packed arguments (a pure function, decoded back,
and decoded again after JAX's own fix-up of them, as cuDNN receives them), the grouped-query gate on the
installed JAX's fix-up, zero gradients at padding whatever cuDNN's backward leaves there, the check that
JAX's private cuDNN module still has what infjax calls (fails loudly when it moves), the choice of
implementation and its fallbacks (on this CPU, and for a GPU or TPU target described by a stand-in device),
and TPU splash attention in Pallas interpret mode under shard_map inside a whole sharded train step on the
8-device CPU mesh. The Pallas GPU kernel has its own file (test_gpu_flash.py, interpret mode); whole train
steps compiled for a compile-only H100 and TPU v5e are in tests/accelerators/.

What cannot run on a CPU: cuDNN's kernel itself (it exists only on a GPU). `python -m infjax.bench
accelerator` checks it on the hardware against the explicit path (outputs, gradients, a bf16 training run).
"""
import dataclasses
import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from infjax.models import attention as A, kernels
from infjax.models.kernels import gpu, tpu


@dataclasses.dataclass(frozen=True)
class StandIn:
    """What infjax asks of a target device (a compile-only one in tests/accelerators/)."""
    platform: str
    compute_capability: str = "9.0"
    device_kind: str = "NVIDIA H100 80GB HBM3"


H100 = StandIn("gpu")
A100 = StandIn("gpu", "8.0", "NVIDIA A100-SXM4-80GB")
TPU = StandIn("tpu", "", "TPU v5 lite")
JAX_FIXED_GQA = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3]) >= (0, 11, 1)


def _decode(lengths, offsets, t):
    """Run ids [B, T] (1, 2, ... in order, 0 where no sequence covers a token) from cuDNN's packed arguments."""
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
    """Run ids 1, 2, ... per row in order of appearance: each run of one id is a sequence for cuDNN, a run of
    padding (0) included (it attends to itself only)."""
    seg = np.asarray(seg)
    out = np.zeros_like(seg)
    for b, row in enumerate(seg):
        n, prev = 0, None
        for i, s in enumerate(row):
            if s != prev:
                n += 1
            out[b, i] = n
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


def _as_cudnn_reads(segment_ids, heads=2, head_dim=8, kv_heads=None, max_segments=1):
    """What cuDNN is given for these segment ids by `gpu.cudnn_attention`: its call captured (cuDNN itself
    replaced), then passed through JAX's own fix-up of packed arguments (`_fix_seqlen_offsets`) and, as
    JAX's lowering does, with the offsets dropped where a row has one slot. Returns, per row, the token
    spans [(start, stop)] that cuDNN treats as one sequence each, and the kv spans likewise."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    b, t = seg.shape
    kv_heads = kv_heads or heads
    captured = {}

    def fake(**kwargs):
        captured.update(kwargs)
        return kwargs["query"]

    q = jnp.ones((b, t, heads, head_dim), jnp.bfloat16)
    k = jnp.ones((b, t, kv_heads, head_dim), jnp.bfloat16)
    original = gpu._cudnn.dot_product_attention
    gpu._cudnn.dot_product_attention = fake
    try:
        gpu.cudnn_attention(q, k, k, seg, max_segments=max_segments)
    finally:
        gpu._cudnn.dot_product_attention = original
    lengths, offsets = captured["q_seqlen"], captured["q_offsets"]
    slots = gpu._cudnn.get_max_seg_per_batch(offsets)
    fixed = gpu._cudnn._fix_seqlen_offsets(lengths, captured["kv_seqlen"], offsets, captured["kv_offsets"],
                                           captured["query"], captured["key"])
    spans = [[] for _ in range(b + 1)]           # the last: spans past the end of the buffer
    kv_spans = [[] for _ in range(b + 1)]
    if slots <= 1:              # JAX's lowering passes no offsets: each row's first `length` tokens
        for row, n in enumerate(np.asarray(fixed[0]).reshape(b, -1)[:, 0]):
            spans[row].append((0, int(n)))
        return spans, spans, slots
    lengths, kv_lengths, q_off, kv_off = (np.asarray(x).reshape(-1) for x in fixed)
    for out, lens, offs, n_heads in ((spans, lengths, q_off, heads), (kv_spans, kv_lengths, kv_off, kv_heads)):
        for n, off in zip(lens, offs):
            if n > 0:
                token = int(off) // (n_heads * head_dim)
                out[min(token // t, b)].append((token % t, token % t + int(n)))
    return spans, kv_spans, slots


def _spans(row):
    """[(start, stop)] of the runs of one id (padding's included) in a row of segment ids."""
    out, start = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[start]:
            out.append((start, i))
            start = i
    return out


@pytest.mark.parametrize("rows", [
    [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]],        # left-padded decoder rows
    [[0] * 8, [1] * 8],                                            # a row of padding only beside a full one
    [[1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0]],          # right padding; padding on both sides
])
def test_cudnn_reads_each_padded_row_where_its_text_is(rows):
    """A padded batch (one text per row) reaches cuDNN with its offsets, decoded the way JAX decodes them: the
    text of a left-padded row is read where it is (the tokens `last` pooling reads among them), and each run
    of padding is a sequence of its own, so no token is left unwritten and no length is -1. With one slot
    JAX would drop the offsets and cuDNN would read the first tokens of each row as the text instead."""
    spans, kv_spans, slots = _as_cudnn_reads(rows)
    assert slots >= 2, "JAX drops the offsets of rows with a single segment slot"
    assert spans == kv_spans == [_spans(r) for r in rows] + [[]]


def test_cudnn_reads_the_texts_of_packed_rows_and_grouped_kv_heads_as_the_installed_jax_places_them():
    """Packed rows, 4 query heads over 1 kv head: decoded from JAX's fix-up, the query spans are each text's;
    the key spans are right exactly where the installed JAX scales kv offsets by the kv heads (>= 0.11.1),
    which is what the grouped-query gate (`gqa_offsets_error`) reads."""
    rows = [[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 2, 2, 2, 2, 2, 2]]
    spans, kv_spans, _ = _as_cudnn_reads(rows, heads=4, kv_heads=1, max_segments=3)
    assert spans == [_spans(r) for r in rows] + [[]]
    assert (kv_spans == spans) == JAX_FIXED_GQA == (gpu.gqa_offsets_error() is None)


def test_the_grouped_query_gate_follows_the_installed_jax(monkeypatch, caplog):
    """`choose` on an H100 for Qwen2.5's 12 query / 2 kv heads in bf16: cuDNN where the installed JAX places
    grouped kv offsets right, else the Pallas kernel, with one warning naming the JAX version and the way
    out. Equal head counts take cuDNN either way."""
    monkeypatch.setattr(gpu, "cudnn_version", lambda: 92801)
    q = jax.ShapeDtypeStruct((4, 512, 12, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 512, 2, 128), jnp.bfloat16)
    with kernels.targeting([H100]):
        grouped = A.choose(q, kv, causal=True)
        assert A.choose(q, q, causal=True).impl == "cudnn"
        A._REPORTED.clear(), A._WARNED.clear()
        with caplog.at_level(logging.INFO, logger=A.log.name):
            for length in (64, 128):       # two shapes, one reason: one warning
                jax.eval_shape(lambda a, b: A.attention(a, b, b, jnp.ones((1, length), jnp.int32), causal=True),
                               jnp.zeros((1, length, 4, 16), jnp.bfloat16), jnp.zeros((1, length, 1, 16), jnp.bfloat16))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if JAX_FIXED_GQA:
        assert grouped[:2] == ("cudnn", "auto on gpu") and not warnings
    else:
        assert grouped.impl == "pallas" and jax.__version__ in grouped.reason and "0.11.1" in grouped.reason
        assert len(warnings) == 1 and "attention: pallas" in warnings[0] and "0.11.1" in warnings[0]


def test_padding_gets_exactly_zero_gradient_whatever_cudnn_leaves_there(monkeypatch):
    """cuDNN does not write the gradients of tokens outside every segment. Stood in by an attention whose
    backward returns ones (not zeros) at every token, q/k/v still get exactly 0 at padding tokens, and
    the real tokens get what the stand-in gives them."""
    @jax.custom_vjp
    def leaky(q, k, v):
        return q + k + v

    leaky.defvjp(lambda q, k, v: (q + k + v, None),
                 lambda _, g: (jnp.ones_like(g), jnp.ones_like(g), jnp.ones_like(g)))
    monkeypatch.setattr(gpu._cudnn, "dot_product_attention", lambda **kw: leaky(kw["query"], kw["key"], kw["value"]))
    seg = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 2, 2, 0, 0]], jnp.int32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 2, 8)), jnp.bfloat16)
    grads = jax.jit(jax.grad(lambda q, k, v: gpu.cudnn_attention(q, k, v, seg, max_segments=2).astype(jnp.float32)
                             .sum(), argnums=(0, 1, 2)))(x, x, x)
    pad = np.asarray(seg == 0)
    for g in grads:
        g = np.asarray(g, np.float32)
        assert np.all(g[pad] == 0) and np.all(g[~pad] == 1)


def test_segment_slots_take_the_callers_bound_and_the_padding_never_one():
    assert gpu.segment_slots(1, 512) == 3 and gpu.segment_slots(None, 1) == 2
    assert gpu.segment_slots(8, 512) == 10 and gpu.segment_slots(None, 512) == 512
    assert gpu.segment_slots(64, 32) == 32


def test_what_cudnn_computes_on_its_sequences_is_the_attention_and_exactly_zero_at_padding():
    """cuDNN attends within each sequence it is given. Emulated on the sequences decoded from JAX's fix-up of
    infjax's arguments (texts and runs of padding, over q/k/v zeroed at padding), the output equals the
    explicit path on real tokens (causal, left padding and packed rows) and is exactly 0 at padding, so
    infjax needs no masking of cuDNN's output."""
    seg = np.asarray([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 3, 0, 0], [0] * 8], np.int32)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(3, 8, 2, 8)), jnp.float32) for _ in range(3))
    captured = {}

    def fake(**kwargs):
        captured.update(kwargs)
        return kwargs["query"]

    original = gpu._cudnn.dot_product_attention
    gpu._cudnn.dot_product_attention = fake
    try:
        gpu.cudnn_attention(q, k, v, jnp.asarray(seg), causal=True, max_segments=3)
    finally:
        gpu._cudnn.dot_product_attention = original
    fixed = gpu._cudnn._fix_seqlen_offsets(captured["q_seqlen"], captured["kv_seqlen"], captured["q_offsets"],
                                           captured["kv_offsets"], captured["query"], captured["key"])
    runs = np.zeros(seg.size, np.int32)              # the sequence of each token of the flattened batch
    for n, (length, offset) in enumerate(zip(np.asarray(fixed[0]).ravel(), np.asarray(fixed[2]).ravel()), 1):
        if length > 0:
            start = int(offset) // (2 * 8)
            runs[start:start + int(length)] = n
    assert runs.all(), "a token outside every sequence would be left unwritten"
    runs = runs.reshape(seg.shape)
    emulated = A.attention(captured["query"], captured["key"], captured["value"], jnp.asarray(runs), causal=True,
                           impl="explicit")
    want = A.attention(q, k, v, jnp.asarray(seg), causal=True, impl="explicit")
    real = seg > 0
    np.testing.assert_allclose(np.asarray(emulated)[real], np.asarray(want)[real], rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(emulated)[~real] == 0)


def test_a_target_gpu_or_tpu_refuses_the_other_platforms_kernel_and_warns_of_dropout(monkeypatch, caplog):
    """Compiling for a GPU, splash (a TPU kernel) would run interpreted: refused, with the reason; for a TPU,
    the Pallas GPU kernel likewise. An A100 does not take cuDNN's packed rows (compute capability 8.0).
    Attention dropout on an accelerator takes the explicit path with a warning saying what it costs."""
    monkeypatch.setattr(gpu, "cudnn_version", lambda: 92801)
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    with kernels.targeting([H100]):
        assert kernels.platform() == "gpu" and gpu.compute_capability() == (9, 0)
        impl, reason = A.choose(q, q, impl="splash")[:2]
        assert impl == "explicit" and "splash does not run on gpu" in reason
        assert A.choose(q, q).impl == "cudnn"
        assert A.choose(q, q, window=8).impl == "pallas"             # two-sided window: not cuDNN's
        A._REPORTED.clear(), A._WARNED.clear()
        x = jnp.zeros((2, 32, 2, 16), jnp.float32)
        with caplog.at_level(logging.INFO, logger=A.log.name):
            A.attention(x, x, x, jnp.ones((2, 32), jnp.int32), dropout=lambda p, deterministic: p)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "[T, T]" in warnings[0] and "dropout" in warnings[0]
    with kernels.targeting([A100]):
        impl, reason = A.choose(q, q)[:2]
        assert impl == "pallas" and "compute capability 9.0" in reason
    with kernels.targeting([TPU]):
        assert A.choose(q, q).impl == "splash"
        impl, reason = A.choose(q, q, impl="pallas")[:2]
        assert impl == "explicit" and "does not run on tpu" in reason
    assert kernels.platform() == "cpu"


def test_the_cudnn_compute_capability_checks_answer_for_the_target_inside_targeting_only():
    before = gpu._cudnn.check_compute_capability("9.0")
    with kernels.targeting([H100]):
        assert gpu._cudnn.check_compute_capability("9.0") and not gpu._cudnn.check_compute_capability("10.0")
        assert gpu._cudnn.is_cuda_compute_capability_equal("9.0")
    assert gpu._cudnn.check_compute_capability("9.0") == before is False


def test_on_cpu_the_accelerator_paths_fall_back_to_explicit_saying_why(caplog):
    q = jax.ShapeDtypeStruct((2, 100, 4, 32), jnp.bfloat16)
    impl, reason = A.choose(q, q, impl="cudnn")[:2]
    assert impl == "explicit" and reason == "cudnn: no GPU"
    impl, reason = A.choose(q, q, impl="splash")[:2]
    assert impl == "explicit" and "row length 100 is not a multiple of splash's block of 128" in reason
    impl, reason = A.choose(q, q, causal=True, window=4, impl="cudnn")[:2]
    assert impl == "explicit"
    two_sided = A.choose(q, q, window=4, impl="cudnn") if gpu.on_gpu() else None
    assert two_sided is None
    assert A.choose(q, q, dropout=True, impl="pallas")[:2] == ("explicit", A.DROPOUT_REASON)
    f32 = jax.ShapeDtypeStruct((2, 128, 4, 32), jnp.float32)
    assert A.choose(f32, f32, impl="pallas")[:2] == ("pallas", "asked for")      # interpret mode off a GPU
    assert A.choose(f32, f32, impl="splash")[:2] == ("splash", "asked for")
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
    from infjax.models.encoder import load_encoder
    from infjax.runtime import mesh as mesh_lib
    from infjax.training import embed, setup as setup_lib
    from infjax import losses
    from tests.helpers.configs import padded_builder, small_config

    monkeypatch.setenv(A.ENV, impl)
    config = small_config("multi_pi")
    encoder, params, path = load_encoder(config.model)
    build = padded_builder(config, path, 128, 128)
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


def test_the_pallas_triton_status_follows_the_installed_jax_and_says_nothing_where_it_is_not_deprecated(caplog):
    """jax 0.12 deprecates the Pallas Triton backend of the Pallas GPU kernel (the line it gives and JAX's own
    warning at each lowering: tests/accelerators/test_compile_h100.py); an older jax says nothing of it, and then
    infjax neither logs a line nor filters any warning."""
    deprecated = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= (0, 12)
    assert gpu.triton_status() == ("deprecated" if deprecated else None)
    if deprecated:
        return
    gpu.note_triton_deprecation.cache_clear()
    filters = list(warnings.filters)
    with caplog.at_level(logging.WARNING, logger=gpu.log.name):
        gpu.note_triton_deprecation()
    assert not [r for r in caplog.records if "Pallas Triton backend" in r.getMessage()]
    assert warnings.filters == filters
    gpu.note_triton_deprecation.cache_clear()


def test_a_shape_only_model_load_for_a_tpu_logs_no_attention_choice(tmp_path, caplog):
    """Loading a model traces its init on 1-token rows, which no accelerator kernel takes: that init computes
    nothing, so it must not log an attention fallback (a WARNING at every TPU model load)."""
    from infjax import config as config_lib
    from infjax.models.encoder import load_encoder
    from tests.helpers.targets import tiny_folder

    c = config_lib.base_config("multi_pi").model
    c.checkpoint = tiny_folder("qwen2", tmp_path)
    A._REPORTED.clear(), A._WARNED.clear()
    with kernels.targeting([TPU]), caplog.at_level(logging.INFO, logger=A.log.name):
        load_encoder(c, weights=False)
    assert not [r for r in caplog.records if r.name == A.log.name], [r.getMessage() for r in caplog.records]
