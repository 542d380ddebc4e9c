"""Load a trained model back from a run directory (any saved step), for export and evaluation.

Whether a folder is a run directory is answered here: `saved_steps` lists its finished checkpoints, and
`load_run` refuses a folder without one (`NotARunDirectory`, one line naming it).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from infjax.errors import UserError
from infjax.models import folder as folder_lib, lora as lora_lib
from infjax.models.encoder import Encoder, load_encoder
from infjax.models.hf import files as hf_files
from infjax.runtime import checkpoint, mesh as mesh_lib, partitioning, storage


@dataclasses.dataclass
class RunModel:
    config: ml_collections.ConfigDict   # the run's resolved config, as saved in the checkpoint
    encoder: Encoder
    params: dict                        # {"shared": tree} or {"query": tree, "passage": tree}
    base_path: str                      # the HF folder the run started from (tokenizer, config.json)
    step: int
    # LoRA runs: `params` have the adapters merged into the base (and `encoder` has none); these are the
    # adapters as trained (+ the interaction head) and their spec, for an adapter-only export
    adapters: dict | None = None
    lora: lora_lib.LoraSpec | None = None


class NonFiniteParams(UserError):
    """A saved model with NaN or infinite parameters: nothing should be exported or evaluated from it."""


def first_nonfinite(tree) -> tuple[str, int, int] | None:
    """(path, non-finite count, size) of the first floating-point leaf of `tree` holding NaN or inf, else None."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        if isinstance(leaf, np.ndarray):          # host arrays stay on the host (no device copy)
            bad = leaf.size - int(np.count_nonzero(np.isfinite(leaf)))
        else:
            bad = int(jax.device_get(jnp.sum(~jnp.isfinite(leaf))))
        if bad:
            return jax.tree_util.keystr(path, simple=True, separator="/"), bad, int(leaf.size)
    return None


def check_finite(params, where: str) -> None:
    """Refuse parameters holding NaN or inf, naming the first bad tensor."""
    found = first_nonfinite(params)
    if found:
        name, bad, size = found
        raise NonFiniteParams(f"{where}: parameter {name} holds {bad} non-finite value(s) of {size}; the model "
                              f"is broken (train with a finite learning rate; resume from an earlier step)")


def saved_steps(workdir: str) -> list[int]:
    """The complete checkpoint steps of the run in `workdir` ([]: no run directory).

    `workdir` is a local folder or an object-store URL."""
    return checkpoint.finished_steps(storage.join(workdir, "checkpoints"))


class NotARunDirectory(UserError, FileNotFoundError):
    """A folder given as a run directory that holds no finished checkpoint."""


class BaseNotFound(UserError):
    """A run's base checkpoint (its model.checkpoint) is not where the run was trained from."""


BASE_FLAG = "--base_checkpoint"      # how export and evaluate name a base checkpoint that moved


def _base_model(config, workdir: str, base: str | None):
    """The encoder (shapes only) of the run's config.model.

    It is read from `base` when given (a base checkpoint that moved since the run); a base that cannot be found
    is one line naming BASE_FLAG."""
    if base is not None:
        config.model.checkpoint = base
    try:
        return load_encoder(config.model, weights=False)
    except hf_files.CheckpointNotFound as e:
        why = str(e).split(" To use a local checkpoint", 1)[0].rstrip(".")
        raise BaseNotFound(f"{workdir}: the run's base checkpoint (model.checkpoint={config.model.checkpoint}) "
                           f"cannot be read: {why}; if it moved, name it with {BASE_FLAG}=FOLDER") from None
    except folder_lib.FolderUnusable as e:
        raise folder_lib.FolderUnusable(f"{workdir}: the run's base checkpoint (model.checkpoint="
                                        f"{config.model.checkpoint}) cannot be used: {e}") from None


BEST = "best"          # the step a run's checkpoint.keep_best kept


def parse_step(text: str | None) -> int | str | None:
    """A --step flag: a step number, BEST, or None (the latest); UserError (one line, exit 2) otherwise."""
    if text is None or text == BEST:
        return text
    if not text.strip().isdigit():
        raise UserError(f"--step={text}: expected a step number or {BEST}")
    return int(text)


def best_step(workdir: str, steps: list[int]) -> int:
    """The step checkpoint.keep_best kept, as the run's latest checkpoint records it (`checkpoint.BEST_KEY`)."""
    ckpts = checkpoint.Checkpoints(workdir, max_to_keep=len(steps) + 1)
    try:
        record = ckpts.saved_data_position(steps[-1]).get(checkpoint.BEST_KEY) or {}
    finally:
        ckpts.close()
    if record.get("step") is None:
        raise FileNotFoundError(f"{workdir} kept no best checkpoint (train with config.checkpoint.keep_best="
                                f"<eval set>/<metric>); saved steps: {steps}")
    if record["step"] not in steps:
        raise FileNotFoundError(f"{workdir}: its best checkpoint by {record['metric']} (step {record['step']}) is "
                                f"gone; saved steps: {steps}")
    return int(record["step"])


def load_run(workdir: str, step: int | str | None = None, mesh=None, on_host: bool = False,
             dtype: str | None = None, base: str | None = None) -> RunModel:
    """The run's model at `step` (default: the latest; BEST: checkpoint.keep_best's), restoring only the parameters.

    Shapes come from the model's abstract init (only the base folder's config.json is read, never its
    weights); the optimizer moments are not read. The parameters land on `mesh` (default: all devices on
    the data axis) laid out by the family's partition rules, or, with `on_host`, as host numpy arrays
    (what export writes from: nothing on devices). `dtype` (e.g. "bfloat16") casts floating parameters
    while they are read; default: as saved (float32).

    A LoRA run's checkpoint holds its adapters: they are read, then the base checkpoint's weights (refused if
    they are not the ones the run trained on), and the model is returned with the adapters merged in.
    `base` reads the base checkpoint from there instead of the saved model.checkpoint (it moved). A `workdir`
    without a finished checkpoint is NotARunDirectory, a `step` it did not save FileNotFoundError."""
    steps = saved_steps(workdir)
    if not steps:
        raise NotARunDirectory(f"{workdir} is not an infjax run directory: no checkpoints/<step> inside")
    step = steps[-1] if step is None else best_step(workdir, steps) if step == BEST else step
    if step not in steps:
        raise FileNotFoundError(f"{workdir} has no checkpoint for step {step}; saved steps: {steps}")
    ckpts = checkpoint.Checkpoints(workdir, max_to_keep=len(steps) + 1)
    try:
        saved_config = ckpts.saved_config(step)
        config = ml_collections.ConfigDict({k: v for k, v in saved_config.items()
                                            if k not in ("base_model", folder_lib.TOKENIZER_KEY)})
        encoder, abstract, base_path = _base_model(config, workdir, base)
        refuse_other_tokenizer(workdir, step, saved_config.get(folder_lib.TOKENIZER_KEY), base_path)
        lora = encoder.lora
        if lora is not None:                   # a LoRA run saved its adapters (+ head): the base is read later
            params = ckpts.restore_params(step, lora_lib.split(abstract)[0], on_host=True)
        else:
            if dtype is not None:
                abstract = lora_lib.cast_floating(abstract, jnp.dtype(dtype))
            if not on_host:
                abstract = checkpoint.abstract_like(abstract, partitioning.param_shardings(
                    abstract, encoder.module, mesh or mesh_lib.default_mesh()))
            params = ckpts.restore_params(step, abstract, on_host=on_host)
    finally:
        ckpts.close()
    check_finite(params, f"{workdir} step {step}")
    if lora is not None:
        return _merged_run(workdir, config, saved_config.get("base_model"), encoder, params, step, mesh, on_host,
                           dtype)
    return RunModel(config, encoder, params, base_path, step)


class BaseChanged(UserError):
    """A run's base checkpoint no longer holds what the run trained with.

    That is the tokenizer, or (LoRA) the weights its adapters were trained on."""


def refuse_other_tokenizer(workdir: str, step: int, saved: dict | None, base_path: str) -> None:
    """The run's base folder must hold the tokenizer the run trained with (recorded by runs since it was)."""
    if saved:
        why = folder_lib.other_tokenizer(saved, folder_lib.record(base_path))
        if why:
            raise BaseChanged(f"{workdir} step {step}: {why}, or name where the run's base is now with "
                              f"{BASE_FLAG}=FOLDER")


def _merged_run(workdir: str, config, base: dict | None, encoder: Encoder, adapters: dict, step: int, mesh,
                on_host: bool, dtype: str | None) -> RunModel:
    """A LoRA run as a plain model: the base checkpoint's weights with the adapters folded in (`lora.merge`).

    The base weights are read in float32 and checked against the hash the run saved."""
    model = ml_collections.ConfigDict(config.model.to_dict())
    model.lora.base_dtype = "float32"
    _, loaded, base_path = load_encoder(model, weights=True)
    if base is not None:
        weights = hf_files.weights_digest(base_path)
        if weights != base["weights"]:
            raise BaseChanged(f"{workdir}: its LoRA adapters were trained on {base['checkpoint']} (weights "
                              f"{base['weights']}), but {base_path} now holds weights {weights}; restore that "
                              f"checkpoint to use this run, or name where it is now with {BASE_FLAG}=FOLDER")
    spec = encoder.lora
    whole = lora_lib.combine(adapters, lora_lib.split(loaded)[1])
    params = {k: (lora_lib.merge(v, spec) if k in lora_lib.TOWERS else v) for k, v in whole.items()}
    del loaded, whole
    plain = encoder.without_lora()
    if dtype is not None:
        params = lora_lib.cast_floating(params, jnp.dtype(dtype))
    if not on_host:
        params = mesh_lib.put(params, partitioning.param_shardings(params, plain.module,
                                                                   mesh or mesh_lib.default_mesh()))
    return RunModel(config, plain, params, base_path, step, adapters=adapters, lora=spec)
