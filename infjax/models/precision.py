"""bfloat16 computes, float32 sums: how a float32 parameter enters a computation in the compute dtype.

With `model.dtype=bfloat16` the parameters stay float32 and the model computes in bfloat16. Autodiff turns
every operation that *spreads* one parameter value over many positions into a *sum* over those positions in
the backward pass, taken in the dtype of the spread value:

- a gather from an embedding table: each row's gradient is a scatter-add of the gradients of every token
  that reads it (BERT's token-type row 0 is read by every token of the batch);
- a broadcast of a bias or a norm scale over rows and tokens: its gradient is a reduction over them.

Cast to bfloat16 *before* spreading (what `flax.linen.Embed` and `Dense` do with `dtype=bfloat16`), those
sums run in bfloat16. Its 8-bit mantissa drops every addend smaller than 2^-9 of the running total, so a
row read by thousands of tokens keeps a fraction of its gradient (on a CPU, 16,896 adds of 0.01 give 4.0, not
169), and on Hopper GPUs a bfloat16 scatter-add is a compare-and-swap loop per element where a float32 one is
a native atomic add. Spread in float32 and cast the spread values instead: the forward pass computes exactly
the same numbers (rounding commutes with copying), and the backward sums in float32.

The residual stream is the other half of the rule, and the one choice it leaves (`model.residual_dtype`,
`residual_dtype` below). torch.autocast, the setup the paper trains with (Hugging Face Trainer, `bf16=True`),
runs the matmuls and attention in bfloat16 and everything else on float32 weights in float32: the embedding
output, every residual add, every norm. Kept in bfloat16 instead, the stream is rounded at every add, so each
layer's small update loses its last bits against the running sum, and the backward's sum over layers does the
same. With last-token pooling (the decoders' presets), where one token's state is the embedding, that put some
of SmolLM2-135M's gradients 21% from float32, where autocast is within 9% (docs/benchmarks.md, bf16 gradients).
"float32" (the default) keeps the stream, the norms and the embedding lookups in float32 as autocast does:
every family adds a block's output onto the stream with `add`. "compute" keeps them in the compute dtype: the
stream's saved activations take half the memory, at the precision above.

`take` and `spread` are the two ways a parameter is spread, and `matmul` the product whose kernel gradient
(a sum over every token) is a float32 dot; `Embed`, `Dense` and the norms of models/layers.py use them, so
every family (BERT, ModernBERT, Llama, Qwen2) and LoRA's adapters follow the one rule. `repeat` does
the same for activations (the key/value heads that grouped-query attention shares, on the portable attention
path). The fused kernels (cuDNN, Pallas, splash, the CPU kernel) sum in float32 inside.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp


# model.residual_dtype: the dtype of the residual stream, the norms and the embedding lookups, when the model
# computes in a lower precision ("float32": as torch.autocast; "compute": the compute dtype).
RESIDUAL_DTYPES = ("float32", "compute")


def residual_dtype(dtype: Any, choice: str = "float32") -> jnp.dtype:
    """The residual stream's dtype for compute dtype `dtype` under `choice` (one of `RESIDUAL_DTYPES`)."""
    if choice not in RESIDUAL_DTYPES:
        raise ValueError(f"residual_dtype={choice!r}; expected one of {RESIDUAL_DTYPES}")
    return jnp.dtype(jnp.float32 if choice == "float32" else (dtype or jnp.float32))


def add(stream: jax.Array, branch: jax.Array) -> jax.Array:
    """A residual add: `branch` (a block's output, in the compute dtype) onto `stream`, in the stream's dtype."""
    return stream + branch.astype(stream.dtype)


def in_float32(fn: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """An elementwise activation `fn` (GELU, SiLU) computed in float32 on a lower-precision input.

    On a lower-precision input it computes in float32 and rounds once to the input's dtype, forward and backward, as
    torch's kernels compute a bf16 activation. Left to XLA in bfloat16, GELU is a chain of bf16 operations, each
    rounded (MiniLM's gradients were then further from float32 than autocast's on 84 of 101 leaves, 31 with this). The
    backward recomputes from the saved low-precision input: no float32 copy of the activation is kept. A float32 input
    is `fn`'s own, autodiff and all."""

    @jax.custom_vjp
    def low(x):
        return fn(x.astype(jnp.float32)).astype(x.dtype)

    def low_fwd(x):
        return low(x), x

    def low_bwd(x, ct):
        _, vjp = jax.vjp(fn, x.astype(jnp.float32))
        return (vjp(ct.astype(jnp.float32))[0].astype(x.dtype),)

    low.defvjp(low_fwd, low_bwd)

    @functools.wraps(fn)
    def apply(x: jax.Array) -> jax.Array:
        return fn(x) if jnp.finfo(x.dtype).bits >= 32 else low(x)
    return apply


def take(table: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """Rows `ids` of `table` in `dtype`: gathered from the float32 table, then cast, so that the gradient is a
    float32 scatter-add into the table."""
    return jnp.take(table, ids, axis=0).astype(dtype or table.dtype)


def spread(param: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """`param` broadcast to `shape` (its trailing axes), then cast to `dtype`: its gradient is a float32
    reduction over the broadcast axes."""
    return jnp.broadcast_to(param, shape).astype(dtype or param.dtype)


def matmul(x: jax.Array, kernel: jax.Array, dtype: Any, out_dtype: Any = None) -> jax.Array:
    """`x @ kernel` over x's last axis, in `dtype` (the output in `out_dtype`, default `dtype`).

    For a float32 `kernel` [in, out]. In a lower precision (bf16) the kernel's gradient, a sum over every row and token
    of x, is computed by a dot whose output is float32 (`preferred_element_type`) and goes to the parameter without a
    rounding to `dtype`: a bf16 dot's accumulation type is otherwise left to the backend (XLA:CPU in jax 0.12 sums such
    products with a 10% error at a few thousand tokens). In float32 it is flax's product, autodiff and all: the same
    numbers as before, bit for bit."""
    dtype, out_dtype = jnp.dtype(dtype or kernel.dtype), jnp.dtype(out_dtype or dtype or kernel.dtype)
    if dtype == kernel.dtype and jnp.finfo(dtype).bits >= 32:      # float32 compute: autodiff's own dot already
        return _product(x.astype(dtype), kernel, out_dtype)            # sums and returns the gradient in float32
    return _matmul(x.astype(dtype), kernel, dtype, out_dtype)


def _product(x, kernel, out_dtype):
    return jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x, kernel, dtype, out_dtype):
    return _product(x, kernel, out_dtype)


def _matmul_fwd(x, kernel, dtype, out_dtype):
    return _matmul(x, kernel, dtype, out_dtype), (x, kernel)


def _matmul_bwd(dtype, out_dtype, residuals, ct):
    x, kernel = residuals
    ct = ct.astype(dtype)
    # d x: contracts the output features (as autodiff would, in the compute dtype)
    d_x = jax.lax.dot_general(ct, kernel.astype(dtype), (((ct.ndim - 1,), (1,)), ((), ())))
    # d kernel: contracts every row and token, in float32
    x2, ct2 = x.reshape(-1, x.shape[-1]), ct.reshape(-1, ct.shape[-1])
    d_kernel = jax.lax.dot_general(x2, ct2, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def repeat(x: jax.Array, repeats: int, axis: int) -> jax.Array:
    """`x` with each entry along `axis` repeated (grouped-query attention's key/value heads), in x's dtype:
    repeated in float32 and cast back, so that the gradient sums the copies in float32."""
    return jnp.repeat(x.astype(jnp.float32), repeats, axis=axis).astype(x.dtype)


class Embed(nn.Embed):
    """flax's `nn.Embed` (the same `embedding` parameter and initializer) whose lookups sum their gradient in
    float32 (`take`)."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"{self.name}: token ids must be integers, not {inputs.dtype}")
        if self.num_embeddings == 1:
            return spread(self.embedding[0], inputs.shape + (self.features,), self.dtype)
        return take(self.embedding, inputs, self.dtype)

    def row(self, index: int, shape: tuple[int, ...]) -> jax.Array:
        """Row `index` added at every position of `shape` (e.g. BERT's token type 0 for a batch that has no
        other): a broadcast, whose gradient is a reduction, instead of a gather and a scatter-add."""
        return spread(self.embedding[index], tuple(shape) + (self.features,), self.dtype)


class Dense(nn.Dense):
    """flax's `nn.Dense` (the same `kernel` and `bias`, the same product) whose kernel gradient is a float32 dot
    (`matmul`) and whose bias is added with `spread` (its gradient a float32 reduction over the rows)."""

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (inputs.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        dtype = self.dtype or jnp.result_type(inputs.dtype, kernel.dtype)
        y = matmul(inputs, kernel, dtype)
        if bias is not None:
            y = y + spread(bias, y.shape, y.dtype)
        return y
