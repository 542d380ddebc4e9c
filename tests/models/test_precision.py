"""models/precision.py: a float32 parameter spread into a bf16 computation gives the same forward values as
flax's modules, and its gradient is the float32 sum of the bf16 cotangents (numpy in float64 is the reference)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax.benchmarks import hlo
from infjax.models import layers as L, precision

BF16 = jnp.bfloat16
TOKENS, WIDTH = 4096, 8          # a row read by 4096 tokens: a bf16 running sum stalls long before


def exact_sum(cotangent, axes) -> np.ndarray:
    """The sum of the (bf16) cotangent values in float64."""
    return np.asarray(cotangent, np.float64).sum(axis=axes)


def relative(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def cotangent():
    """[1, TOKENS, WIDTH] bf16 values of one sign, so that a bf16 sum of them would stall (the sum of 4096
    values near 0.01 reaches 40, where bf16's spacing is 0.25)."""
    rng = np.random.default_rng(0)
    return jnp.asarray(0.01 + 0.002 * rng.random((1, TOKENS, WIDTH)), BF16)


def _vjp(module, params, x, ct):
    out, pullback = jax.vjp(lambda p: module.apply({"params": p}, x), params)
    return out, pullback(ct.astype(out.dtype))[0]


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_embed_and_dense_compute_what_flax_computes(dtype):
    """Forward values bit for bit equal to flax's nn.Embed / nn.Dense on the same parameters, and in float32 the
    same gradients (only how a bf16 gradient is summed changes): checkpoints and exports are untouched."""
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 50, (3, 7)))
    table = {"embedding": jnp.asarray(rng.standard_normal((50, WIDTH)), jnp.float32)}
    ours = precision.Embed(50, WIDTH, dtype=dtype).apply({"params": table}, ids)
    theirs = nn.Embed(50, WIDTH, dtype=dtype).apply({"params": table}, ids)
    assert ours.dtype == theirs.dtype == dtype and np.array_equal(np.asarray(ours, np.float32),
                                                                  np.asarray(theirs, np.float32))
    x = jnp.asarray(rng.standard_normal((3, 7, WIDTH)), jnp.float32)
    dense = {"kernel": jnp.asarray(rng.standard_normal((WIDTH, 5)), jnp.float32),
             "bias": jnp.asarray(rng.standard_normal(5), jnp.float32)}
    ct = jnp.asarray(rng.standard_normal((3, 7, 5)), dtype)
    ours, ours_grads = _vjp(precision.Dense(5, dtype=dtype), dense, x, ct)
    theirs, their_grads = _vjp(nn.Dense(5, dtype=dtype), dense, x, ct)
    assert ours.dtype == theirs.dtype == dtype and np.array_equal(np.asarray(ours, np.float32),
                                                                  np.asarray(theirs, np.float32))
    if dtype == jnp.float32:
        for name in ("kernel", "bias"):
            np.testing.assert_allclose(ours_grads[name], their_grads[name], rtol=1e-6, atol=1e-6)


def test_a_row_read_by_every_token_gets_the_float32_sum_of_their_gradients(cotangent):
    ids = jnp.full((1, TOKENS), 3, jnp.int32)
    table = {"embedding": jnp.zeros((10, WIDTH), jnp.float32)}
    out, grads = _vjp(precision.Embed(10, WIDTH, dtype=BF16), table, ids, cotangent)
    assert out.dtype == BF16 and grads["embedding"].dtype == jnp.float32
    g = np.asarray(grads["embedding"])
    assert relative(g[3], exact_sum(cotangent[0], 0)) < 1e-5
    assert not g[np.arange(10) != 3].any()
    # the broadcast row (BERT's token type 0 when no ids are given): the same sum, without a scatter
    module = precision.Embed(10, WIDTH, dtype=BF16)
    _, pullback = jax.vjp(lambda p: module.apply({"params": p}, 0, (1, TOKENS), method=module.row), table)
    g = np.asarray(pullback(cotangent)[0]["embedding"])
    assert relative(g[0], exact_sum(cotangent[0], 0)) < 1e-5 and not g[1:].any()


def test_a_kernel_a_bias_and_a_norm_scale_get_the_float32_sum_over_every_token(cotangent):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, TOKENS, 4)), jnp.float32)
    params = {"kernel": jnp.zeros((4, WIDTH), jnp.float32), "bias": jnp.zeros(WIDTH, jnp.float32)}
    _, grads = _vjp(precision.Dense(WIDTH, dtype=BF16), params, x, cotangent)
    assert relative(grads["bias"], exact_sum(cotangent, (0, 1))) < 1e-5
    # the kernel's gradient is a sum over the tokens too: x^T ct of the bf16 values, in float32
    x16 = np.asarray(jnp.asarray(x, BF16), np.float64)[0]
    want = x16.T @ np.asarray(cotangent, np.float64)[0]
    assert grads["kernel"].dtype == jnp.float32 and relative(grads["kernel"], want) < 1e-5
    y = jnp.asarray(np.random.default_rng(3).standard_normal((1, TOKENS, WIDTH)), jnp.float32)
    out, grads = _vjp(L.RMSNorm(dtype=BF16), {"scale": jnp.ones(WIDTH, jnp.float32)}, y, cotangent)
    y32 = np.asarray(y, np.float64)
    normed = (y32 / np.sqrt(np.mean(y32 ** 2, axis=-1, keepdims=True) + 1e-6)).astype(np.float32)
    # each token's term is a bf16 product (computed in bf16, rounded once); their sum is float32's. numpy's
    # normalisation may round a token's y the other way at a bf16 boundary (one term one bf16 step off: ~1e-4);
    # a bf16 running sum of these 4096 terms of both signs would be ~10% off
    terms = np.asarray(cotangent, np.float64) * np.asarray(jnp.asarray(normed, BF16), np.float64)
    want = exact_sum(np.asarray(jnp.asarray(terms, BF16), np.float64), (0, 1))
    assert out.dtype == BF16 and relative(grads["scale"], want) < 1e-3


def test_repeated_heads_sum_their_gradients_in_float32():
    """Grouped-query attention's shared key/value heads (8 query heads on one): each head's gradient is the sum
    of its 8 copies' taken in float32 (exact for 8 bf16 values of one sign) and rounded once to bf16."""
    rng = np.random.default_rng(4)
    ct = jnp.asarray(0.01 + 0.002 * rng.random((1, TOKENS, 8, WIDTH)), BF16)
    out, pullback = jax.vjp(lambda x: precision.repeat(x, 8, axis=2), jnp.zeros((1, TOKENS, 1, WIDTH), BF16))
    (g,) = pullback(ct)
    assert out.dtype == g.dtype == BF16 and out.shape == ct.shape
    want = jnp.asarray(np.asarray(ct, np.float64).sum(axis=2, keepdims=True), BF16)
    assert np.array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


def test_flax_modules_would_sum_in_bf16_and_these_do_not():
    """What JAX is asked to compute (the lowered program, before any compiler pass): flax's bf16 nn.Embed and
    nn.Dense scatter-add and reduce their gradients in bf16; precision's in float32."""
    ids = jnp.zeros((2, 16), jnp.int32)

    def lowered(embed_cls, dense_cls):
        def loss(p):
            x = embed_cls(10, WIDTH, dtype=BF16).apply({"params": p["e"]}, ids)
            return dense_cls(3, dtype=BF16).apply({"params": p["d"]}, x).astype(jnp.float32).sum()
        params = {"e": {"embedding": jnp.zeros((10, WIDTH))}, "d": {"kernel": jnp.zeros((WIDTH, 3)),
                                                                   "bias": jnp.zeros(3)}}
        return jax.jit(jax.grad(loss)).lower(params).as_text(dialect="hlo")

    flax_sums = hlo.low_precision_sums(lowered(nn.Embed, nn.Dense))
    assert {s.split()[0] for s in flax_sums} == {"scatter", "reduce"}, flax_sums
    assert hlo.low_precision_sums(lowered(precision.Embed, precision.Dense)) == []
