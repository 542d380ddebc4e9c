"""The fused CPU attention kernel (infjax/models/cpu_attention.cc through the XLA FFI) against XLA's own
attention: outputs and gradients under every mask the backbones use, on the sharded 8-device mesh, and the
build cache that compiles it once per machine."""
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from infjax import errors
from infjax.models import attention as A
from infjax.models.kernels import cpu as C

pytestmark = pytest.mark.skipif(not C.available(), reason="no C++ compiler to build the CPU attention kernel")


def _segments(t):
    """Three rows: two texts then padding; one-token texts beside a long one; padding only."""
    seg = np.zeros((3, t), np.int32)
    seg[0, :10], seg[0, 10:t - 5] = 1, 2
    seg[1, 0], seg[1, 1], seg[1, 2:t - 1] = 1, 2, 3
    return jnp.asarray(seg)


def _check_against_xla(q, k, v, seg, **mask):
    real = (seg > 0)[:, :, None, None]
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * real

    def loss(impl):
        return lambda q, k, v: jnp.sum(A.attention(q, k, v, seg, impl=impl, **mask) * weights)
    out = A.attention(q, k, v, seg, impl="kernel", **mask)
    ref = A.attention(q, k, v, seg, impl="xla", **mask)
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, ref, 0), atol=2e-6)
    assert not np.any(np.asarray(out)[~np.asarray(seg > 0)])          # padding rows: zero
    got = jax.jit(jax.grad(loss("kernel"), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(a, b, atol=2e-5 * float(np.max(np.abs(b))), err_msg=f"d{name}")


@pytest.mark.parametrize("d,heads,kv_heads,t,causal,window", [
    (32, 4, 4, 37, False, None),      # MiniLM head size; a length that is no multiple of the 16-key tile
    (64, 4, 2, 50, True, None),       # grouped-query decoder
    (16, 2, 1, 40, False, 5),         # ModernBERT's local window inside segments
    (128, 2, 2, 33, True, 7),         # causal and windowed at once
])
def test_kernel_equals_xla_outputs_and_gradients(d, heads, kv_heads, t, causal, window):
    rng = np.random.default_rng(0)
    seg = _segments(t)
    q = jnp.asarray(rng.normal(size=(3, t, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, t, kv_heads, d)), jnp.float32) for _ in range(2))
    _check_against_xla(q, k, v, seg, causal=causal, window=window)


def test_kernel_takes_a_traced_window():
    """ModernBERT's scanned layers pass the window as a traced scalar, -1 on the global layers."""
    rng = np.random.default_rng(0)
    seg = _segments(24)
    q, k, v = (jnp.asarray(rng.normal(size=(3, 24, 2, 32)), jnp.float32) for _ in range(3))
    run = jax.jit(lambda w: A.attention(q, k, v, seg, window=w, impl="kernel"))
    real = np.asarray(seg > 0)
    for traced, fixed in ((jnp.int32(3), 3), (jnp.int32(-1), None)):
        np.testing.assert_allclose(np.asarray(run(traced))[real],
                                   np.asarray(A.attention(q, k, v, seg, window=fixed, impl="xla"))[real], atol=2e-6)


def test_key_ranges_are_the_segment_cut_by_the_masks():
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    lo, hi = C.key_ranges(seg, causal=False, window=None)
    assert lo.tolist() == [[0, 0, 0, 3, 3, 0]] and hi.tolist() == [[3, 3, 3, 5, 5, 0]]
    lo, hi = C.key_ranges(seg, causal=True, window=1)
    assert lo.tolist() == [[0, 0, 1, 3, 3, 0]] and hi.tolist() == [[1, 2, 3, 4, 5, 0]]


def test_kernel_runs_on_each_devices_rows_of_a_sharded_batch():
    """Under the 8-device mesh the batch stays split: no all-gather in the compiled step, same numbers."""
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(16, 24, 2, 32)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(np.repeat(np.array([[1] * 10 + [2] * 10 + [0] * 4]), 16, axis=0))

    def grads(q, k, v, seg):
        return jax.grad(lambda q, k, v: jnp.sum(A.attention(q, k, v, seg, impl="kernel") ** 2), (0, 1, 2))(q, k, v)
    sharded = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v, seg)]
    step = jax.jit(grads)
    assert "all-gather" not in step.lower(*sharded).compile().as_text()
    for a, b in zip(step(*sharded), jax.jit(grads)(q, k, v, seg)):
        assert a.sharding.spec[0] == "data"
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_auto_takes_the_kernel_on_cpu_and_the_environment_overrides_it(monkeypatch):
    q = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.float32)
    assert A.choose(q, q)[:2] == ("kernel", "auto on cpu")
    bf16 = jax.ShapeDtypeStruct((2, 64, 4, 32), jnp.bfloat16)
    impl, reason = A.choose(bf16, bf16)[:2]                       # bfloat16: the kernel passes, saying why
    assert impl == "explicit" and reason.startswith("kernel: takes float32")
    monkeypatch.setenv(A.ENV, "explicit")
    assert A.choose(q, q).impl == "explicit"
    assert A.choose(q, q, impl="kernel").impl == "kernel"
    monkeypatch.setenv(A.ENV, "fast")
    with pytest.raises(errors.ConfigError, match="INFJAX_ATTENTION='fast'"):
        A.choose(q, q)


@pytest.fixture(scope="module")
def built_library():
    """The kernel as the default cache holds it (built there once if it is not)."""
    return C._build()


@pytest.mark.parametrize("damage", ["truncated", "no record"])
def test_a_damaged_library_in_the_cache_is_built_again_not_loaded(tmp_path, monkeypatch, caplog, damage,
                                                                   built_library):
    import shutil

    monkeypatch.setenv("INFJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    library = C.cache_dir() / built_library.name              # a cache holding a good build, then damaged
    library.parent.mkdir(parents=True)
    for name in (built_library.name, built_library.name + ".sha256"):
        shutil.copy(built_library.parent / name, library.parent / name)
    whole = library.read_bytes()
    if damage == "truncated":
        library.write_bytes(whole[: len(whole) // 3])             # what a full disk or a kill mid-copy leaves
        expected = "damaged (size and SHA-256"
    else:
        (library.parent / (library.name + ".sha256")).unlink()
        expected = "damaged (no record of its size and hash)"
    assert C._build() == library and len(library.read_bytes()) == len(whole)
    assert expected in caplog.text and C._damage(library) is None


def test_build_compiles_once_into_the_cache_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("INFJAX_KERNEL_CACHE", str(tmp_path / "cache"))
    first = C._build()
    stamp = first.stat().st_mtime_ns
    assert C._build() == first and first.stat().st_mtime_ns == stamp       # the second call reuses the file
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, first.name + ".sha256"]

    broken = tmp_path / "cxx"                 # a compiler that answers --version but fails to compile
    broken.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken-cxx 1.0; exit 0; fi\n"
                      "echo 'error: no space left' >&2; exit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("INFJAX_KERNEL_CACHE", str(tmp_path / "other"))
    with pytest.raises(RuntimeError, match="failed to build cpu_attention.cc:\nerror: no space left"):
        C._build()
    assert os.listdir(tmp_path / "other") == []


def test_packing_costs_rows_per_text_only_where_the_kernel_runs(monkeypatch):
    """The packed-shape chooser's attention cost (training/setup.attention_span): per text (infinite span)
    with the kernel, whole rows with attention dropout, bfloat16, an unsupported head size or another path."""
    from infjax.data import packing
    from infjax.models.encoder import load_encoder
    from infjax.training import setup as setup_lib
    from tests.helpers.configs import small_config

    assert A.costs_per_text(32, jnp.float32)
    assert not A.costs_per_text(32, jnp.float32, dropout=True)
    assert not A.costs_per_text(32, jnp.bfloat16) and not A.costs_per_text(48, jnp.float32)
    encoder = load_encoder(small_config("multi_pi").model).encoder           # the tiny BERT: 2 heads of 16
    assert setup_lib.attention_span(encoder, dropout=False) == float("inf")
    assert setup_lib.attention_span(encoder, dropout=True) == packing.ATTENTION_SPAN
    monkeypatch.setenv(A.ENV, "explicit")
    assert not A.costs_per_text(32, jnp.float32)
    assert setup_lib.attention_span(encoder, dropout=False) == packing.ATTENTION_SPAN
