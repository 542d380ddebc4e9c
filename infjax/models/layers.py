"""Building blocks shared by the infjax backbones (ModernBERT, Llama, Qwen2).

What is really shared lives here; what differs between families stays in the
family's module:

- :class:`RMSNorm` (Llama / Qwen2; HF semantics: normalise in float32, cast
  back, then scale).
- RoPE in Hugging Face's rotate-half layout (:func:`rope_inv_freq`,
  :func:`rope_cos_sin`, :func:`apply_rope`): the first and second halves of
  each head are the two coordinates of the rotated pairs, exactly as the HF
  checkpoints expect, so no weight is ever permuted. ``RopeConfig`` covers
  the "default" and "llama3" frequency schedules.
- attention itself is :func:`infjax.models.attention.attention` (segment
  ids, causal, local window, grouped-query heads, dropout).
- :func:`gated`: the GLU product ``act(a) * b`` used by both the Llama MLP
  (separate gate/up projections) and ModernBERT's GeGLU (one fused ``Wi``).
- :func:`run_layers`: a stack of identical blocks, unrolled (parameters
  ``layer_{i}``) or scanned (parameters stacked under ``layers`` with a
  leading layer axis), rematerialised under a policy (models/remat.py); :func:`stack_layers` /
  :func:`unstack_layers` convert between the two parameter layouts.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from infjax.models import precision, remat as remat_lib
from infjax.models.lora import LoraDense, LoraSpec


def gelu_erf(x: jax.Array) -> jax.Array:
    """The exact GELU as torch computes it, ``x/2 * (1 + erf(x/sqrt(2)))``.

    ``jax.nn.gelu(approximate=False)`` goes through ``erfc`` instead (more exact far in the negative tail, by < 1e-6
    absolute): XLA:CPU runs that as two branch-selecting fusions, and a MiniLM train step at 64/256 tokens takes ~10%
    longer."""
    return 0.5 * x * (1 + jax.lax.erf(x * np.asarray(2 ** -0.5, x.dtype)))


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


# Hugging Face activation names (ACT2FN) -> JAX functions. "gelu" is the exact erf GELU; the tanh variants are
# the approximation. In bfloat16 each computes in float32 and rounds once (precision.in_float32), as torch does.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    name: precision.in_float32(fn) for name, fn in {
        "gelu": gelu_erf,
        "gelu_new": gelu_tanh,
        "gelu_pytorch_tanh": gelu_tanh,
        "relu": jax.nn.relu,
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
    }.items()}


def activation(name: str, source: str = "config.json", key: str = "hidden_act") -> Callable:
    """The activation called ``name`` in HF configs, or ValueError naming the key."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"{source}: {key}={name!r} is not supported; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def dense(features: int, name: str, *, use_bias: bool, dtype: Any, param_dtype: Any,
          std: float = 0.02, lora: LoraSpec | None = None, role: str | None = None) -> Callable:
    """A Linear layer; kernel [in, out] is the transpose of the HF ``weight`` [out, in].

    Its kernel and bias gradients are float32 sums (`precision.Dense`). With a `lora` spec that names its `role` (q, k,
    v, o, gate, up, down, or a fused qkv / gate_up), it carries an adapter. Its output is named by its role for the
    remat policies (models/remat.py)."""
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
              kernel_init=nn.initializers.normal(stddev=std), name=name)
    module = LoraDense(features, lora=lora, **kw) if lora is not None and lora.applies(role) else \
        precision.Dense(features, **kw)
    return lambda x: remat_lib.tag(module(x), role)


class RMSNorm(nn.Module):
    """Root-mean-square norm as in HF ``LlamaRMSNorm``: float32 statistics, then ``scale * x`` in the compute
    dtype (the scale spread in float32: its gradient is a float32 sum, models/precision.py)."""

    epsilon: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return precision.spread(scale, y.shape, self.dtype) * y.astype(self.dtype)


def layer_norm(epsilon: float, name: str, *, dtype: Any, param_dtype: Any, use_bias: bool = False,
               two_pass_variance: bool = True) -> nn.LayerNorm:
    """LayerNorm; `two_pass_variance` computes the variance as torch does (ModernBERT's norms have no bias).

    BERT keeps flax's one-pass variance, which its checkpoints and runs were trained and tested with (the two differ by
    ~1e-6 on MiniLM; changing it would change every BERT run's numbers)."""
    return nn.LayerNorm(epsilon=epsilon, use_bias=use_bias, use_fast_variance=not two_pass_variance,
                        dtype=dtype, param_dtype=param_dtype, name=name)


# --------------------------------------------------------------------------
# Rotary position embeddings (HF rotate-half layout)
# --------------------------------------------------------------------------

ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Frequencies of a rotary embedding: base ``theta`` and an optional "llama3" schedule."""

    theta: float = 10000.0
    rope_type: str = "default"           # default | llama3
    factor: float = 1.0                  # llama3: scaling factor of the low frequencies
    low_freq_factor: float = 1.0         # llama3
    high_freq_factor: float = 4.0        # llama3
    original_max_position_embeddings: int = 8192   # llama3

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, theta: float | None, source: str,
                key: str = "rope_parameters") -> "RopeConfig":
        """From an HF ``rope_parameters`` / ``rope_scaling`` dict (either format) and a fallback theta.

        Unsupported rope types (linear, dynamic, yarn, ...) and a partial
        rotary factor raise ``ValueError`` naming the key.
        """
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: {key} rope_type={rope_type!r} is not supported; expected one of "
                             f"{list(ROPE_TYPES)}")
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"{source}: {key} partial_rotary_factor={params['partial_rotary_factor']!r} "
                             "is not supported (only 1.0)")
        theta = params.get("rope_theta", theta)
        if theta is None:
            raise ValueError(f"{source}: no rope_theta in {key} or at the top level")
        if rope_type == "default":
            return cls(theta=float(theta))
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in params]
        if missing:
            raise ValueError(f"{source}: {key} of rope_type 'llama3' lacks {missing}")
        return cls(theta=float(theta), rope_type="llama3", factor=float(params["factor"]),
                   low_freq_factor=float(params["low_freq_factor"]),
                   high_freq_factor=float(params["high_freq_factor"]),
                   original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32, computed as transformers does)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(rope.factor), inv_freq).astype(np.float32)
    smooth = ((rope.original_max_position_embeddings / wavelen - rope.low_freq_factor)
              / (rope.high_freq_factor - rope.low_freq_factor)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(rope.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, L, head_dim] (float32) for integer positions [B, L]; both halves repeat."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
    """(x1, x2) -> (-x2, x1) over the last axis, split in halves (HF layout)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate heads x [B, L, N, D] by cos/sin [B, L, D] (float32 math, result in x's dtype)."""
    x32 = x.astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)


# --------------------------------------------------------------------------
# Gating
# --------------------------------------------------------------------------


def gated(act: Callable[[jax.Array], jax.Array], a: jax.Array, b: jax.Array) -> jax.Array:
    """The GLU product ``act(a) * b`` (SwiGLU with silu, GeGLU with gelu)."""
    return act(a) * b


class GatedMLP(nn.Module):
    """Llama-style MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases."""

    intermediate_size: int
    act: str = "silu"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora: LoraSpec | None = None       # adapters on the roles gate, up, down it names

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, lora=self.lora)
        h = gated(ACTIVATIONS[self.act], dense(self.intermediate_size, "gate_proj", role="gate", **kw)(x),
                  dense(self.intermediate_size, "up_proj", role="up", **kw)(x))
        return dense(x.shape[-1], "down_proj", role="down", **kw)(h)


# --------------------------------------------------------------------------
# Layer stacks: unrolled or scanned, rematerialised under a policy
# --------------------------------------------------------------------------

SCANNED = "layers"        # parameter name of a scanned (stacked) block of layers


def run_layers(layer_cls: type[nn.Module], layer_kwargs: Mapping[str, Any], x: jax.Array,
               per_layer: Sequence[Any], shared: Sequence[Any], *, first: int, remat: Any, scan: bool,
               select: Callable | None = None, sharding: Any = None) -> jax.Array:
    """Apply layers ``first .. first + len(per_layer) - 1`` of a stack to ``x``.

    Must be called inside a compact ``__call__``. Each layer is
    ``layer_cls(**layer_kwargs)(x, *args)``. Unrolled, layer ``i`` is named
    ``layer_{i}`` and ``args = select(per_layer[i], *shared)`` (or ``shared``
    when ``select`` is None). Scanned, one module named ``layers`` holds every
    parameter with a leading layer axis, ``per_layer`` becomes a scanned array
    and ``select`` runs inside the scan body on a traced value.

    ``sharding`` (a ``jax.sharding.Sharding`` of ``x``, or None) is imposed on
    every layer's input. Training splits the rows over the batch mesh axes
    this way: left to itself, the partitioner meets fsdp-sharded kernels by
    splitting each matmul over its contracting dimension, so every device
    computes every row and all-reduces whole activations (Qwen2.5-1.5B
    shapes, fsdp=8: 56 GiB per device); with the rows pinned it gathers the
    kernels instead (ZeRO-3).
    """
    constrain = (lambda y: y) if sharding is None else (lambda y: jax.lax.with_sharding_constraint(y, sharding))
    cls = remat_lib.wrap(layer_cls, remat, scan)
    pick = select or (lambda _, *s: tuple(s))
    if not scan:
        for offset, value in enumerate(per_layer):
            x = cls(**layer_kwargs, name=f"layer_{first + offset}")(constrain(x), *pick(value, *shared))
        return x

    def body(module, carry, value, shared_args):
        return module(constrain(carry), *pick(value, *shared_args)), None

    scanned = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                      in_axes=(0, nn.broadcast), length=len(per_layer))
    x, _ = scanned(cls(**layer_kwargs, name=SCANNED), x, jnp.asarray(np.asarray(per_layer)), tuple(shared))
    return x


def stack_layers(params: Mapping, first: int, count: int) -> dict:
    """Unrolled tree (``layer_{first}`` .. ``layer_{first+count-1}``) -> scanned tree (``layers``)."""
    out = {k: v for k, v in params.items() if not _is_layer_key(k, first, count)}
    names = [f"layer_{i}" for i in range(first, first + count)]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"parameter tree lacks {missing} to stack")
    out[SCANNED] = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *[params[n] for n in names])
    return out


def unstack_layers(params: Mapping, first: int) -> dict:
    """Scanned tree (``layers`` with a leading layer axis) -> unrolled ``layer_{i}``; other trees unchanged."""
    if SCANNED not in params:
        return dict(params)
    out = {k: v for k, v in params.items() if k != SCANNED}
    stacked = params[SCANNED]
    count = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(count):
        out[f"layer_{first + i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return out


def _is_layer_key(key: str, first: int, count: int) -> bool:
    return key.startswith("layer_") and key[6:].isdigit() and first <= int(key[6:]) < first + count
