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

from infjax import cli, config as config_lib, losses
from infjax.benchmarks import torch_gradients, train as bench_train
from infjax.data import pipeline
from infjax.models import encoder as encoder_lib, lora, precision
from infjax.models.hf import files as hf_files
from infjax.training import setup as setup_lib, step as step_lib

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
    """(loss, gradients as numpy float32, the float32 parameters used) of `config`'s first batch in `dtype`.

    The model computes in `dtype`; with `with_setup`, the run's `bench_train.Setup` is a fourth item. `params`: the
    float32 model tree to start from (default: the checkpoint's). One device; no dropout (both dtypes compute the same
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


def compare(config, records: list[dict] | None = None, params=None, tolerance: float = LEAF_TOLERANCE,
            hf_names: bool = False) -> dict:
    """The two gradients of `config`'s first batch (float32 and bfloat16 compute) compared leaf by leaf.

    Returns {"loss": {dtype: value}, "leaves": [LeafError, ...] worst first, "passed": every leaf finite and within
    `tolerance`}. `hf_names`: the leaves under Hugging Face's names (one shared tower, no adapters), as `torch_anchor`
    names its own."""
    loss32, g32, params = run_gradient(config, "float32", records, params)
    loss16, g16, _ = run_gradient(config, "bfloat16", records, params)
    if hf_names:
        folder = encoder_lib.checkpoint_path(config.model.checkpoint)
        g32, g16 = named(g32, folder), named(g16, folder)
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

    cli.define_config(fv, "Config file, e.g. configs/multi_pi.py[:preset]; --config.KEY=VALUE overrides a key.",
                      lock_config=False)
    flags.DEFINE_bool("vs_torch", False, "beside infjax's, torch.autocast's bf16 gradient against torch's float32 "
                      "through the Hugging Face model, same texts and parameters (one text per row, as Hugging Face "
                      "trains; needs torch and transformers)", flag_values=fv)
    flags.DEFINE_string("residual_dtypes", "float32,compute", "the model.residual_dtype choices to measure, "
                        "comma-separated", flag_values=fv)
    flags.DEFINE_integer("worst", 5, "leaves listed per comparison, worst first", flag_values=fv)


def named(grads, folder: str) -> dict:
    """A gradient tree of one shared tower under Hugging Face's parameter names (float64 arrays)."""

    family = encoder_lib.detect_family(folder)
    tree = grads["shared"] if "shared" in grads else grads
    return {k: np.asarray(v, np.float64)
            for k, v in family.names.to_hf(tree, family.config.from_hf_dict(hf_files.load_hf_config(folder))).items()}


def padded_batch(config, records: list[dict] | None = None) -> dict:
    """`config`'s first batch with one text per row (data.packing off; nothing compiled): host arrays."""

    c = config_lib.override(config.copy_and_resolve_references(), {"data.packing": False})
    encoder, _, path = encoder_lib.load_encoder(c.model, weights=False)
    data = pipeline.open_training_data(c, path, encoder.padding_side, records=records)
    build = setup_lib.make_batch_setup(c, data, encoder, path, setup_lib.make_objective(c), num_devices=1).build
    return {k: np.asarray(v) for k, v in build(0).items()}


def torch_anchor(config, records: list[dict] | None = None) -> dict:
    """torch.autocast's bf16 gradient against torch's float32 (benchmarks/torch_gradients.py) on `config`'s batch.

    On `config`'s first batch, one text per row: {"loss": {"float32", "autocast"}, "leaves": [LeafError, ...] under
    Hugging Face's names, worst first}. Needs torch and transformers."""

    if config.model.lora.rank or config.model.interaction != "concat" or not config.model.shared_encoder:
        raise config_lib.ConfigError("the torch anchor computes one shared backbone's gradients: it takes "
                                     "model.lora.rank=0, model.interaction=concat, model.shared_encoder=True")
    folder = encoder_lib.checkpoint_path(config.model.checkpoint)
    family = encoder_lib.detect_family(folder)
    objective = setup_lib.make_objective(config)
    pooling = encoder_lib.resolve_pooling(config.model.pooling, family)
    batch = padded_batch(config, records)

    def loss_fn(iq, p, iq_neg=None):
        return losses.contrastive_loss(objective, iq=iq, p=p, iq_neg=iq_neg)[0]

    (l32, g32), (l16, g16) = (torch_gradients.gradients(folder, family.padding_side, batch, pooling, loss_fn, autocast)
                              for autocast in (False, True))
    names = sorted(g32)
    return {"loss": {"float32": l32, "autocast": l16},
            "leaves": leaf_errors({n: g32[n] for n in names}, {n: g16[n] for n in names})}


def against_anchor(errors: list[LeafError], anchor: list[LeafError]) -> dict:
    """Per leaf (by name), `errors`' relative error over the anchor's: {"median", "largest" ratio, "worse": the
    number of leaves where `errors` is larger, "leaves"}."""
    theirs = {e.path: e.relative for e in anchor}
    ratios = [e.relative / theirs[e.path] for e in errors if theirs.get(e.path)]
    return {"median": float(np.median(ratios)), "largest": float(max(ratios)), "leaves": len(ratios),
            "worse": sum(1 for e in errors if e.path in theirs and e.relative > theirs[e.path])}


def main(argv: list[str]) -> None:

    fv = cli.parse("python -m infjax.bench gradients", define_flags, argv, doc=__doc__.split("\n\n")[0],
                   required=("config",), after=cli.load_config, catch=cli.CONFIG_ERRORS,
                   message=cli.config_flag_error)
    choices = [x.strip() for x in fv.residual_dtypes.split(",") if x.strip()]
    bad = [x for x in choices if x not in precision.RESIDUAL_DTYPES]
    if bad or not choices:
        raise config_lib.ConfigError(f"--residual_dtypes={fv.residual_dtypes!r}: each must be one of "
                                     f"{precision.RESIDUAL_DTYPES}")
    c = config_lib.override(fv.config, {"eval.synthetic": False, "eval.canary": ""})
    folder = encoder_lib.checkpoint_path(c.model.checkpoint)
    print(f"{folder}: pooling {c.model.pooling}, remat {c.model.remat}, scan_layers {c.model.scan_layers}, "
          f"lora rank {c.model.lora.rank}, packing {c.data.packing}, objective {c.objective}, "
          f"batch {c.train.batch_size}; one gradient on the first batch; relative error per leaf "
          f"|g - g_f32| / max(|g_f32|, {NEGLIGIBLE:g} x the largest leaf's)", flush=True)
    loss32, g32, params, setup = run_gradient(c, "float32", params=None, with_setup=True)
    if setup.remat_line:
        print(setup.remat_line)
    names = (lambda g: named(g, folder)) if fv.vs_torch else (lambda g: g)
    columns, losses_line = {}, [f"infjax float32 {loss32:.6f}"]
    for choice in choices:
        loss16, g16, _ = run_gradient(config_lib.override(c, {"model.residual_dtype": choice}), "bfloat16",
                                      params=params)
        columns[f"infjax bf16, residual {choice}"] = leaf_errors(names(g32), names(g16))
        losses_line.append(f"bf16 residual {choice} {loss16:.6f}")
    anchor = None
    if fv.vs_torch:
        anchor = torch_anchor(c)
        columns["torch.autocast bf16 (one text per row)"] = anchor["leaves"]
        losses_line.append(f"torch float32 {anchor['loss']['float32']:.6f}, autocast {anchor['loss']['autocast']:.6f}")
    print("loss: " + "; ".join(losses_line))
    for name, errors in columns.items():
        print(f"\n{name} against float32: worst {errors[0].relative:.2e}, median "
              f"{np.median([e.relative for e in errors]):.2e} over {len(errors)} leaves\n{table(errors, fv.worst)}")
    if anchor is not None:
        for name, errors in list(columns.items())[:-1]:
            r = against_anchor(errors, anchor["leaves"])
            print(f"{name}: further from float32 than torch.autocast on {r['worse']} of {r['leaves']} leaves; "
                  f"its error over autocast's, per leaf: median {r['median']:.2f}, largest {r['largest']:.2f}")
