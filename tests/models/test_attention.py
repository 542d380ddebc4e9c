"""Attention over packed rows (segment ids): the Pallas splash kernel in interpret mode and the explicit and
blockwise implementations equal XLA's (outputs and gradients); positions restart in every segment."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax.models import attention as A
from infjax.models.kernels import reference as R


@pytest.mark.parametrize("causal,window", [pytest.param(False, None, marks=pytest.mark.slow),
                                           pytest.param(True, None, marks=pytest.mark.slow), (False, 40)])
def test_splash_attention_in_interpret_mode_equals_xla(causal, window):
    """The Pallas TPU splash kernel (interpret mode on CPU), 2 blocks of 128: segments, padding, GQA."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 256, 4, 16)), jnp.float32) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    seg = np.zeros((2, 256), np.int32)
    seg[0, :100], seg[0, 100:220] = 1, 2                  # two texts, then padding
    seg[1, :30], seg[1, 30:150], seg[1, 150:] = 1, 2, 3    # a text across the block boundary
    seg = jnp.asarray(seg)
    real = (seg > 0)[:, :, None, None]

    def loss(impl):
        return lambda q, k, v: jnp.sum(jnp.where(real, A.attention(q, k, v, seg, causal=causal, window=window,
                                                                   impl=impl), 0.0) ** 2)
    out = A.attention(q, k, v, seg, causal=causal, window=window, impl="splash")
    ref = A.attention(q, k, v, seg, causal=causal, window=window, impl="xla")
    np.testing.assert_allclose(np.where(real, out, 0), np.where(real, ref, 0), atol=1e-5)
    for a, b in zip(jax.jit(jax.grad(loss("splash"), argnums=(0, 1, 2)))(q, k, v),
                    jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=2e-5 * float(np.max(np.abs(b))))


def test_segment_positions_restart_in_every_segment():
    seg = jnp.array([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 2, 2, 2]])
    np.testing.assert_array_equal(A.segment_positions(seg), [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2], [0, 1, 0, 1, 2]])


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 2)])
@pytest.mark.parametrize("block", [R.BLOCK, 4])
def test_explicit_and_blockwise_attention_equal_xla(causal, window, block):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 4, 8)), jnp.float32) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]                       # grouped-query: 4 query heads over 2 kv heads
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    ref = A.attention(q, k, v, seg, causal=causal, window=window, impl="xla")
    out = A.attention(q, k, v, seg, causal=causal, window=window, impl="explicit", block=block)
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * seg[:, :, None, None]    # real rows only

    def grads(impl_):
        return jax.jit(jax.grad(lambda *x: jnp.sum(A.attention(*x, seg, causal=causal, window=window, impl=impl_,
                                                                block=block) * weights), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(grads("explicit"), grads("xla")):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_blockwise_attention_takes_a_traced_window_and_bfloat16():
    """ModernBERT's scanned layers pass their window as a traced value; the blockwise form (rows of
    BLOCKWISE_FROM tokens and more in the default config) takes it like the one-pass form, in bfloat16 too."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 8)), jnp.float32) for _ in range(3))
    seg = jnp.array([[1] * 5 + [2] * 9 + [0] * 2, [1] * 16])
    ref = A.attention(q, k, v, seg, window=3, impl="xla")
    traced = jax.jit(lambda w: A.attention(q, k, v, seg, window=w, impl="explicit", block=4))(3)
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(traced)[real], np.asarray(ref)[real], atol=1e-5)
    half = A.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), seg, window=3, impl="explicit", block=4)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, np.float32)[real], np.asarray(ref)[real], atol=5e-2)
    grads = jax.jit(jax.grad(lambda *x: jnp.sum(A.attention(*x, seg, window=3, impl="explicit", block=4)
                                                .astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert all(g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
