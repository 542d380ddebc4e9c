"""Every parameter's bfloat16 gradient against its float32 gradient, leaf by leaf.

    rows = gradients.compare(config)      # any run config: its model.dtype is replaced by each of the two

One gradient of the run's own loss (the trainer's gradient function, `training.step.make_grad_fn`) from the
same float32 parameters on the run's first batch, once with the model computing in float32 and once in
bfloat16; for each parameter leaf, the relative error ``|g_bf16 - g_f32| / |g_f32|`` (Frobenius norms over the
leaf). A loss curve cannot show a gradient that is wrong in a few leaves: an embedding table whose rows
are summed in bfloat16 loses most of the gradient of its frequent rows while the loss still falls.

What a correct bfloat16 step gives: every value it computes is rounded to an 8-bit mantissa, a relative
error of at most u = 2^-9 (about 2e-3) per operation, and the errors of the operations a gradient passes
through add up roughly as a random walk, forward and backward. The loss (temperature 0.05) then multiplies
the embeddings' rounding by 20 before its softmax. On the tiny random checkpoints of the tests (every family,
initialized as Hugging Face initializes them, the default config's batch) that gives at most 1.7% on a CPU:
`LEAF_TOLERANCE` is 2.5%. A sum taken in bfloat16 gave 2.8% to 114% there (docs/benchmarks.md). A leaf whose
gradient is a sum over every token of the batch that nearly cancels (a token-type row, a bias, in a model
fresh from its init) shows each term's rounding against a small total: callers with such models pass their
own tolerance (`bench accelerator`'s numerics).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from infjax import config as config_lib
from infjax.benchmarks import train as bench_train
from infjax.models import lora
from infjax.training import step as step_lib

# The relative error a leaf may show by default (docstring above; the figures are in docs/benchmarks.md).
LEAF_TOLERANCE = 0.025
# A leaf whose float32 gradient is below this fraction of the largest leaf's is measured against that fraction of
# the largest instead of its own norm: its gradient is zero but for rounding (BERT's key biases: softmax is
# invariant to a shift shared by every key), and a relative error of rounding noise means nothing.
NEGLIGIBLE = 1e-3


@dataclasses.dataclass(frozen=True)
class LeafError:
    path: str                  # e.g. "shared/embeddings/word_embeddings/embedding"
    relative: float            # |g_bf16 - g_f32| / max(|g_f32|, NEGLIGIBLE x the largest leaf's |g_f32|)
    norm: float                # |g_f32|
    shape: tuple

    def as_dict(self) -> dict:
        return {"path": self.path, "relative": self.relative, "norm": self.norm, "shape": list(self.shape)}


def leaf_path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def run_gradient(config, dtype: str, records: list[dict] | None = None, params=None):
    """(loss, gradients as numpy float32, the float32 parameters used) of `config`'s first batch with the model
    computing in `dtype`. `params`: the float32 model tree to start from (default: the checkpoint's). One
    device; no dropout (both dtypes compute the same function)."""
    c = config_lib.override(config.copy_and_resolve_references(), {"model.dtype": dtype})
    setup = bench_train.Setup(c, records, weights=params is None, devices=jax.devices()[:1])
    params = setup.params if params is None else params
    trainable, frozen = lora.split(params)
    grad_fn = step_lib.make_grad_fn(setup.encoder, setup.objective, dropout=False, chunk_size=c.train.chunk_size,
                                    mesh=setup.mesh)
    (loss, _), grads = jax.jit(grad_fn)(trainable, setup.batch(0), jax.random.key(0), frozen)
    return float(loss), jax.tree.map(lambda g: np.asarray(g, np.float32), grads), params


def leaf_errors(reference, other) -> list[LeafError]:
    """Relative error of each leaf of `other` against `reference` (trees of the same structure), worst first."""
    pairs = [(leaf_path(path), np.asarray(r, np.float64), np.asarray(o, np.float64))
             for (path, r), o in zip(jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(other))]
    floor = NEGLIGIBLE * max((float(np.linalg.norm(r)) for _, r, _ in pairs), default=0.0)
    out = []
    for path, r, o in pairs:
        norm, diff = float(np.linalg.norm(r)), float(np.linalg.norm(o - r))
        scale = max(norm, floor)
        out.append(LeafError(path, diff / scale if scale > 0 else (0.0 if diff == 0 else np.inf), norm,
                             tuple(r.shape)))
    return sorted(out, key=lambda e: -e.relative)


def compare(config, records: list[dict] | None = None, params=None, tolerance: float = LEAF_TOLERANCE) -> dict:
    """The two gradients of `config`'s first batch (float32 and bfloat16 compute) compared leaf by leaf:
    {"loss": {dtype: value}, "leaves": [LeafError, ...] worst first, "passed": every leaf finite and within
    `tolerance`}."""
    loss32, g32, params = run_gradient(config, "float32", records, params)
    loss16, g16, _ = run_gradient(config, "bfloat16", records, params)
    errors = leaf_errors(g32, g16)
    limit = tolerance
    passed = all(np.isfinite(e.relative) and e.relative <= limit for e in errors)
    return {"loss": {"float32": loss32, "bfloat16": loss16}, "leaves": errors, "passed": passed,
            "tolerance": limit}


def table(errors: list[LeafError], worst: int = 5) -> str:
    """The `worst` leaves as text lines: relative error, |g_f32|, shape, path."""
    return "\n".join(f"{e.relative:9.2e}  {e.norm:9.2e}  {str(list(e.shape)):<14} {e.path}" for e in errors[:worst])
