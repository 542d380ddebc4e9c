"""Resuming a run: what a checkpoint must record, and the checks that refuse one that cannot be continued.

A run resumes only where its workdir holds checkpoints and config.resume says so (`check_resume_request`).
Every checkpoint of infjax's trainer records the tokenizer the run read (in its config), the fingerprint of
its training data and the length of its schedule (in its data position); a checkpoint without them was not
written by this trainer, and is refused naming what it lacks. A checkpoint whose LoRA base, tokenizer or
training data changed is refused before its state is read (train.py's `restore_or_start` runs these checks
with the config's own, `config.incompatible_changes`). A run continued with another length says how its
learning-rate schedule changed (`note_schedule_change`).
"""
from __future__ import annotations

import logging

from infjax.errors import ConfigError
from infjax.models import folder as folder_lib
from infjax.models.hf import files as hf_files
from infjax.runtime import checkpoint, storage
from infjax.runtime.restore import saved_steps
from infjax.training import state as state_lib

log = logging.getLogger("infjax.train")      # the lines of the training run

BASE_KEY = "base_model"     # config.json of a LoRA run's checkpoints: {"checkpoint", "weights"} of its base


def check_resume_request(workdir: str, resume: bool) -> None:
    """Without resume the workdir must not hold an earlier run's checkpoints; with it, it must."""
    ckpt = storage.join(workdir, "checkpoints")
    has_ckpt = bool(saved_steps(workdir))
    if has_ckpt and not resume:
        raise FileExistsError(f"--workdir={workdir} already holds checkpoints; pass --config.resume=True to "
                              f"continue that run, or choose a new --workdir")
    if resume and not has_ckpt:
        raise FileNotFoundError(f"config.resume=True but {ckpt} holds no checkpoint to resume from")


def base_identity(checkpoint_name: str, path: str) -> dict:
    """What a LoRA run's adapters belong to: model.checkpoint and a hash of its weight files."""
    return {"checkpoint": checkpoint_name, "weights": hf_files.weights_digest(path)}


def refuse_other_base(step: int, saved: dict | None, current: dict | None) -> None:
    """Adapters trained on one base are meaningless on another: refuse, naming both."""
    if saved is not None and current is not None and saved["weights"] != current["weights"]:
        raise ConfigError(
            f"cannot resume from checkpoint {step}: its LoRA adapters were trained on {saved['checkpoint']} "
            f"(weights {saved['weights']}), but model.checkpoint={current['checkpoint']} has weights "
            f"{current['weights']}; resume with the base the run started from")


def refuse_other_tokenizer(where: str, saved: dict, current: dict) -> None:
    """Refuse checkpoint `where` whose saved config records another tokenizer than the base now holds, or none."""
    key = folder_lib.TOKENIZER_KEY
    if key not in saved:
        _lacks(where, f'the tokenizer the run was trained with ("{key}" in its config)')
    other = folder_lib.other_tokenizer(saved[key], current.get(key))
    if other:
        raise ConfigError(f"cannot resume from {where}: {other}")


def refuse_other_data(where: str, position: dict, fingerprint: dict, resume_if_changed: bool) -> None:
    """Refuse checkpoint `where` whose training data had another fingerprint (unless data.resume_if_changed).

    `position`: the checkpoint's data position, which must record the data's fingerprint (computed as this
    infjax computes it) and the schedule's length.
    """
    saved = position.get("data_fingerprint")
    lacking = []
    if not isinstance(saved, dict) or saved.get("of") != fingerprint.get("of"):
        lacking.append(f'a fingerprint of its training data over {fingerprint.get("of")} ("data_fingerprint" in '
                       f'its data position)')
    if "schedule_steps" not in position:
        lacking.append('the length of its learning-rate schedule ("schedule_steps" in its data position)')
    if lacking:
        _lacks(where, " and ".join(lacking))
    if saved == fingerprint:
        return
    if not resume_if_changed:
        raise ConfigError(
            f"cannot resume from {where}: the training data changed since it was saved (then {saved['records']} "
            f"records, hash {saved['hash']}; now {fingerprint['records']} records, hash {fingerprint['hash']}), "
            f"so the batches of the remaining steps would differ; restore the data, or pass "
            f"--config.data.resume_if_changed=True to go on with the new data")
    log.warning("resuming on changed training data (%s -> %s) as data.resume_if_changed asks", saved, fingerprint)


def _lacks(where: str, what: str) -> None:
    raise ConfigError(f"cannot resume from {where}: it lacks {what}, which every checkpoint of infjax's trainer "
                      f"records (it was written or edited by something else); start the run again in a new "
                      f"--workdir")


def note_schedule_change(config, ckpts: checkpoint.Checkpoints, start: int, steps: int) -> None:
    """Warn when a resumed run's length (and so its learning-rate schedule) differs from checkpoint `start`'s.

    A run continued with another length (train.steps, or epochs over data of another size) follows the
    learning-rate schedule of its new length from the checkpoint on, so that it still decays to its end: one
    line says so, with the rate at the checkpoint's step on both schedules.
    """
    saved = ckpts.saved_data_position(start)["schedule_steps"]
    if saved == steps:
        return
    rate = lambda total: float(state_lib.learning_rate_schedule(   # noqa: E731
        config.train.learning_rate, total, config.train.warmup_steps)(start))
    log.warning("the learning-rate schedule changed: the run now has %d steps where checkpoint %d's had %d, so from "
                "step %d it follows the %d-step schedule (learning rate %.3g at step %d, where the %d-step one had "
                "%.3g)", steps, start, saved, start, steps, rate(steps), start, saved, rate(saved))
