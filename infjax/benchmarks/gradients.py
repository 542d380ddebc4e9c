"""Every parameter's bfloat16 gradient against its float32 gradient, leaf by leaf.

    python -m infjax.bench gradients --config=configs/multi_pi.py [--vs_torch] [--config.KEY=VALUE ...]
    rows = gradients.compare(config)      # any run config: its model.dtype is replaced by each of the two

`bench gradients` prints the worst leaves for each `model.residual_dtype` (models/precision.py), and with
`--vs_torch` beside them the same comparison for torch.autocast through the Hugging Face model on the same batch
and parameters (benchmarks/torch_gradients.py), leaf by leaf under Hugging Face's names.

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


def run_gradient(config, dtype: str, records: list[dict] | None = None, params=None, with_setup: bool = False):
    """(loss, gradients as numpy float32, the float32 parameters used) of `config`'s first batch with the model
    computing in `dtype`; with `with_setup`, the run's `bench_train.Setup` as a fourth item. `params`: the float32
    model tree to start from (default: the checkpoint's). One device; no dropout (both dtypes compute the same
    function)."""
    c = config_lib.override(config.copy_and_resolve_references(), {"model.dtype": dtype})
    setup = bench_train.Setup(c, records, weights=params is None, devices=jax.devices()[:1])
    params = setup.params if params is None else params
    trainable, frozen = lora.split(params)
    # the layers under the policy the run takes (`auto`: the one it chose), not the module's placeholder
    grad_fn = step_lib.make_grad_fn(setup.encoder.with_remat(setup.remat), setup.objective, dropout=False,
                                    chunk_size=c.train.chunk_size, mesh=setup.mesh)
    (loss, _), grads = jax.jit(grad_fn)(trainable, setup.batch(0), jax.random.key(0), frozen)
    out = float(loss), jax.tree.map(lambda g: np.asarray(g, np.float32), grads), params
    return out + (setup,) if with_setup else out


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


# ----------------------------------------------------------------------------------------------------------
# python -m infjax.bench gradients
# ----------------------------------------------------------------------------------------------------------

def define_flags(fv) -> None:
    from absl import flags

    from infjax import cli
    cli.define_config(fv, "Config file, e.g. configs/multi_pi.py[:preset]; --config.KEY=VALUE overrides a key.",
                      lock_config=False)
    flags.DEFINE_bool("vs_torch", False, "beside infjax's, torch.autocast's bf16 gradient against torch's float32 "
                      "through the Hugging Face model, same batch and parameters (padded batch: data.packing off; "
                      "needs torch and transformers)", flag_values=fv)
    flags.DEFINE_string("residual_dtypes", "float32,compute", "the model.residual_dtype choices to measure, "
                        "comma-separated", flag_values=fv)
    flags.DEFINE_integer("worst", 5, "leaves listed per comparison, worst first", flag_values=fv)


def _named(grads, folder: str) -> dict:
    """A gradient tree under Hugging Face's parameter names (the model's tree of one shared tower)."""
    from infjax.models import encoder as encoder_lib
    from infjax.models.hf import files as hf_files

    family = encoder_lib.detect_family(folder)
    tree = grads["shared"] if "shared" in grads else grads
    return {k: np.asarray(v, np.float64)
            for k, v in family.names.to_hf(tree, family.config.from_hf_dict(hf_files.load_hf_config(folder))).items()}


def torch_anchor(config, batch: dict) -> list[LeafError]:
    """torch.autocast's bf16 gradient against torch's float32, leaf by leaf (benchmarks/torch_gradients.py), on
    `batch` (the unpacked batch infjax computed its gradients on)."""
    from infjax.benchmarks import torch_gradients
    from infjax.models import encoder as encoder_lib
    from infjax.training import setup as setup_lib

    folder = encoder_lib.checkpoint_path(config.model.checkpoint)
    family = encoder_lib.detect_family(folder)
    objective = setup_lib.make_objective(config)
    pooling = encoder_lib.resolve_pooling(config.model.pooling, family)

    def loss_fn(iq, p, iq_neg=None):
        from infjax import losses
        return losses.contrastive_loss(objective, iq=iq, p=p, iq_neg=iq_neg)[0]

    out = {}
    for autocast in (False, True):
        out[autocast] = torch_gradients.gradients(folder, family.padding_side, batch, pooling, loss_fn, autocast)
    names = sorted(out[False][1])
    return leaf_errors({n: out[False][1][n] for n in names}, {n: out[True][1][n] for n in names}), \
        {"float32": out[False][0], "autocast": out[True][0]}


def main(argv: list[str]) -> None:
    from infjax import cli
    from infjax.models import encoder as encoder_lib, precision

    fv = cli.parse("python -m infjax.bench gradients", define_flags, argv, doc=__doc__.split("\n\n")[0],
                   required=("config",), after=cli.load_config, catch=cli.CONFIG_ERRORS,
                   message=cli.config_flag_error)
    choices = [x.strip() for x in fv.residual_dtypes.split(",") if x.strip()]
    bad = [x for x in choices if x not in precision.RESIDUAL_DTYPES]
    if bad or not choices:
        raise config_lib.ConfigError(f"--residual_dtypes={fv.residual_dtypes!r}: each must be one of "
                                     f"{precision.RESIDUAL_DTYPES}")
    c = config_lib.override(fv.config, {"eval.synthetic": False, "eval.canary": ""})
    if fv.vs_torch:
        if c.model.lora.rank or c.model.interaction != "concat" or not c.model.shared_encoder:
            raise config_lib.ConfigError("--vs_torch compares one shared backbone's gradients: it takes "
                                         "model.lora.rank=0, model.interaction=concat, model.shared_encoder=True")
        c = config_lib.override(c, {"data.packing": False})
    folder = encoder_lib.checkpoint_path(c.model.checkpoint)
    print(f"{folder}: pooling {c.model.pooling}, remat {c.model.remat}, scan_layers {c.model.scan_layers}, "
          f"lora rank {c.model.lora.rank}, packing {c.data.packing}, objective {c.objective}, "
          f"batch {c.train.batch_size}; one gradient on the first batch; relative error per leaf "
          f"|g - g_f32| / max(|g_f32|, {NEGLIGIBLE:g} x the largest leaf's)", flush=True)
    loss32, g32, params, setup = run_gradient(c, "float32", params=None, with_setup=True)
    if setup.remat_line:
        print(setup.remat_line)
    named = (lambda g: _named(g, folder)) if fv.vs_torch else (lambda g: g)
    columns, losses_line = {}, [f"infjax float32 {loss32:.6f}"]
    for choice in choices:
        loss16, g16, _ = run_gradient(config_lib.override(c, {"model.residual_dtype": choice}), "bfloat16",
                                      params=params)
        columns[f"infjax bf16, residual {choice}"] = leaf_errors(named(g32), named(g16))
        losses_line.append(f"bf16 residual {choice} {loss16:.6f}")
    if fv.vs_torch:
        anchor, anchor_losses = torch_anchor(c, {k: np.asarray(v) for k, v in setup.build(0).items()})
        columns["torch.autocast bf16"] = anchor
        losses_line.append(f"torch float32 {anchor_losses['float32']:.6f}, autocast {anchor_losses['autocast']:.6f}")
    print("loss: " + "; ".join(losses_line))
    for name, errors in columns.items():
        print(f"\n{name} against float32: worst {errors[0].relative:.2e}, median {np.median([e.relative for e in errors]):.2e}"
              f" over {len(errors)} leaves\n{table(errors, fv.worst)}")
    if fv.vs_torch:
        anchor = {e.path: e.relative for e in columns.pop("torch.autocast bf16")}
        for name, errors in columns.items():
            ratios = [e.relative / anchor[e.path] for e in errors if anchor.get(e.path)]
            worse = sum(1 for e in errors if e.relative > anchor.get(e.path, np.inf))
            print(f"{name}: worse than torch.autocast on {worse} of {len(errors)} leaves; error / autocast's per "
                  f"leaf: median {np.median(ratios):.2f}, largest {max(ratios):.2f}")
