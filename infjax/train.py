"""Train an instruction-following bi-encoder: `python -m infjax.train --config=configs/multi_pi.py`.

    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x
    python -m infjax.train --config=configs/multi_pi.py:e5-base-v2 --config.train.steps=1000
    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x --config.resume=True --config.train.steps=300

Side effects (files, logs, checkpoints) live here; the pieces it wires
together (data, models, losses, training) are pure or near it.
"""
# (This docstring is `--help`'s text.) The run is read (`read_inputs`), wired once into one record (`Run`),
# restored or started, evaluated, trained by `train_loop` (next batch, step, log, evaluate, stop, save) and
# evaluated again. The pieces with side effects it calls: runtime/stopping.py (signals, the agreed stop),
# training/saving.py (checkpoints, the line naming the last complete one), training/resume.py (what a resume
# checks), training/nonfinite.py, training/console.py (the log lines), evaluation/in_training.py.
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from typing import Callable, NamedTuple

if __name__ == "__main__":   # glibc reads its tunables once, at start: restart before the heavy imports
    from infjax.runtime.cpu import restart_with_huge_pages
    restart_with_huge_pages()

import jax
import ml_collections
from absl import flags
from jax.sharding import Mesh

from infjax import cli, config as config_lib, errors
from infjax.data import prefetch
from infjax.data.pipeline import BatchSetup, TrainingData, open_training_data, total_steps, widest_step
from infjax.evaluation.in_training import SYNTHETIC_SET, Evaluator
from infjax.evaluation.tasks import preload
from infjax.models import folder as folder_lib, remat as remat_lib
from infjax.models.encoder import load_encoder
from infjax.runtime import checkpoint, distributed, cpu as runtime_cpu, mesh as mesh_lib, platform, storage
from infjax.runtime.stopping import Preemption, agreed_stop
from infjax.training import best as best_lib, console, nonfinite, resume, saving, state as state_lib, \
    workdir as workdir_lib, writers as writers_lib
from infjax.training.best import BestCheckpoint
from infjax.training.setup import abstract_global_batch, compiled_train_step, make_batch_setup, make_objective

log = logging.getLogger("infjax.train")


class RunFilesError(errors.RunStopped):
    """A file of the run (metrics.jsonl, eval.json) could not be written: a full disk, a failing device."""


@dataclasses.dataclass
class TrainResult:
    """What `run` returns."""

    eval: dict                        # {"before": {...}, "after": {...}}: eval.synthetic and eval.canary (eval.json)
    final_step: int
    losses: list[tuple[int, float]]   # (step, loss) of every logged step
    state: state_lib.TrainState
    preempted: str | None             # the signal that stopped the run early, else None


class LoopResult(NamedTuple):
    """What `train_loop` returns."""

    state: state_lib.TrainState
    losses: list[tuple[int, float]]   # (step, loss) of the logged steps
    preempted: str | None             # the stopping signal's name, else None
    canary: dict                      # the canary scores of the final step's evaluation, or {}
    start: int                        # the loop ran steps start+1 .. state.step
    skipped: int                      # of them, skipped as non-finite


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run, wired once (`_run`): what the loop and the phases around it read."""

    config: ml_collections.ConfigDict
    workdir: str                      # absolute, or an object store's URL
    mesh: Mesh
    setup: BatchSetup                 # tokenizer, text format, batch plan, batch builder
    train_step: Callable              # compiled: (state, global batch) -> (state, metrics)
    steps: int                        # the run's length (train.steps, or train.epochs over the data)
    ckpts: checkpoint.Checkpoints
    writer: writers_lib.Writers       # metrics.jsonl, and TensorBoard / W&B
    evaluator: Evaluator
    config_json: dict                 # saved with each checkpoint: the config, and the tokenizer (LoRA: base) read
    fingerprint: dict                 # the training data's
    best: BestCheckpoint | None       # checkpoint.keep_best: the best step so far (None: not kept)

    def position(self, step: int) -> dict:
        """The data position saved with checkpoint `step`: epoch, offset, data fingerprint, schedule length, and
        the best step so far (checkpoint.keep_best)."""
        best = {best_lib.RECORD_KEY: self.best.record()} if self.best is not None else {}
        return {**self.setup.plan.position(step), "data_fingerprint": self.fingerprint, "schedule_steps": self.steps,
                **best}


def run(config, workdir: str) -> TrainResult:
    """Train per `config` in `workdir`: evaluate, train (logging, evaluating, checkpointing), evaluate.

    The workdir is locked for the run (one run per workdir; process 0 holds the lock). Every path of the run
    derives from one root: `workdir` made absolute with `~` expanded (`--workdir=~/x` reaches the shell
    unexpanded), or the URL of an object store. Several processes start together or not at all: one that
    cannot start (its config, its files) stops the others before their first collective.
    """
    workdir = storage.absolute(workdir)
    with contextlib.ExitStack() as held:
        with distributed.all_or_none("before training started"):
            config_lib.validate(config, jax.device_count(), jax.process_count())
            mismatch = config_lib.preset_mismatch(config)
            if mismatch:
                log.warning(mismatch)
            shape = config_lib.describe_shape(config)
            if shape:
                log.info("%s", shape)
            log.info("process %d of %d; %d local devices, %d global devices (%s)", jax.process_index(),
                     jax.process_count(), jax.local_device_count(), jax.device_count(), platform.name())
            log.info(runtime_cpu.describe())
            held.enter_context(workdir_lib.WorkdirLock(workdir, enabled=jax.process_index() == 0))
            resume.check_resume_request(workdir, config.resume)
            inputs = [read_inputs(config)]     # held in a list: _run takes the only reference, and the
        return _run(config, workdir, inputs.pop())   # initial parameters are freed once the state holds them


class RunInputs(NamedTuple):
    """What a run reads before anything compiles (each process alone, no collective)."""

    encoder: object
    params: dict
    model_path: str
    data: TrainingData                # the training records' ids (token cache) and texts
    fingerprint: dict
    objective: object
    specs: list[str]                  # eval.sets
    canaries: list[str]               # eval.canary


def read_inputs(config) -> RunInputs:
    """The model, the training data and the evaluation sets: files are read here, a bad one fails in seconds."""
    encoder, params, model_path = load_encoder(config.model, seed=config.train.seed)
    # Tokenized once (or read from the token cache); the data is compared as the model reads it (a negative, a
    # duplicate): by its token ids.
    data = open_training_data(config, model_path, encoder.padding_side)
    specs, canaries = config_lib.eval_specs(config), config_lib.canary_specs(config)
    preload(specs + canaries + ([SYNTHETIC_SET] if config.eval.synthetic else []),
            synthetic_defaults=config.data.synthetic.to_dict())
    objective = make_objective(config, encoder.module.config.hidden_size)
    return RunInputs(encoder, params, model_path, data, data.fingerprint, objective, specs, canaries)


def _run(config, workdir: str, inputs: RunInputs) -> TrainResult:
    """Wire the run once (`Run`): batches, mesh, sharded state, compiled step, checkpoints, writers; train."""
    encoder, params, model_path, data, fingerprint, objective, specs, canaries = inputs
    del inputs
    setup = make_batch_setup(config, data, encoder, model_path, objective)
    steps = total_steps(config, setup.plan)
    log.info("%d records, %d rows per global batch, %d steps per epoch, %d steps", len(data.store),
             setup.build.global_rows, setup.plan.steps_per_epoch, steps)
    log.info("%s", console.describe_data_cuts(setup.build.data_cuts(), config.data))

    # Mesh, sharded state, compiled step.
    mesh = mesh_lib.make_mesh(config.mesh)
    best = BestCheckpoint.of_config(config)
    if best is not None and best.spec not in specs + canaries:
        specs = specs + [best.spec]          # evaluated in the loop for it
    evaluator = Evaluator(config, encoder, setup, mesh, specs, canaries)
    optimizer, schedule = state_lib.make_optimizer(config.train, steps)
    checkpoint.check_writable(workdir, needed_bytes=checkpoint.state_bytes(
        state_lib.savable(state_lib.abstract_state(params, optimizer, config.train.seed))))
    state, state_sharding = state_lib.create_sharded_state(params, optimizer, config.train.seed, encoder.module, mesh)
    del params
    example = (state, abstract_global_batch(setup.build(widest_step(setup.build)), mesh)) \
        if remat_lib.normalize(config.model.remat) == "auto" else None
    train_step = compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding, example)

    config_json = json.loads(config.to_json_best_effort())
    config_json[folder_lib.TOKENIZER_KEY] = folder_lib.record(model_path)   # what a resume compares
    if encoder.lora is not None:
        config_json[resume.BASE_KEY] = resume.base_identity(config.model.checkpoint, model_path)
        log_lora(encoder, state, config_json[resume.BASE_KEY])
    ckpts = checkpoint.Checkpoints(workdir, config.checkpoint.max_to_keep, config.checkpoint.async_save)
    distributed.on_lost(lambda cause: str(saving.lost_error(ckpts, cause)))   # the peer watcher's last line
    writer = writers_lib.Writers(workdir, writers_lib.writer_names(config.log.writers), config_json,
                                 enabled=jax.process_index() == 0)
    run = Run(config=config, workdir=workdir, mesh=mesh, setup=setup, train_step=train_step, steps=steps,
              ckpts=ckpts, writer=writer, evaluator=evaluator, config_json=config_json, fingerprint=fingerprint,
              best=best)
    try:                   # the views (TensorBoard) are closed on every path
        return _train(run, state)
    finally:
        writer.close()


def _train(run: Run, state) -> TrainResult:
    """Restore or start, evaluate before, train, evaluate after; eval.json.

    A signal's clock (train.stop_grace_s) runs until this returns or raises.
    """
    preemption = Preemption(run.config.train.stop_grace_s, lambda: saving.last_complete(run.ckpts))
    try:
        results, loop = _train_until_stopped(run, state, preemption)
        return _finish(run, results, loop)
    finally:
        preemption.disarm()


def _train_until_stopped(run: Run, state, preemption: Preemption) -> tuple[dict, LoopResult]:
    """Restore or start, evaluate before, train: eval.json's "before" entry and the loop's result.

    The checkpoints are closed (the last asynchronous save waited for) on every path; a full disk under the
    run's files is one line naming the last complete checkpoint.
    """
    ckpts, lost = run.ckpts, False
    try:                   # the manager is closed on every path (else its threads report errors at exit) ...
        with saving.lost_process_stops(ckpts):
            start, state, position = restore_or_start(run.config, ckpts, state, run.config_json, run.fingerprint)
            if run.best is not None:
                run.best.restore(position.get(best_lib.RECORD_KEY))
                ckpts.keep(run.best.step)
            if start:
                resume.note_schedule_change(run.config, ckpts, start, run.steps)
            if start >= run.steps:
                log.warning("checkpoint step %d >= train.steps %d: nothing to train", start, run.steps)
            run.writer.start(start)
            results = {"before": run.evaluator.before(state, start, run.writer)} if run.evaluator.milestones() else {}
            loop = train_loop(run, state, start, preemption)
            saving.close_checkpoints(ckpts)    # waits for asynchronous saves
    except distributed.ProcessLost:
        lost = True                            # ... but when another process is gone: closing would wait for it
        raise
    except OSError as e:
        if e.errno not in errors.DEVICE_ERRNOS:
            raise
        raise RunFilesError(f"{errors.describe(e)}; {saving.last_complete(ckpts, ' once there is room')}") from e
    finally:
        if not lost:
            saving.close_checkpoints(ckpts, quiet=True)
        run.writer.flush()                     # object stores: the records not yet written
    return results, loop


def _finish(run: Run, results: dict, loop: LoopResult) -> TrainResult:
    """The end of the run: the count of skipped steps, the stop line, or the evaluation after and eval.json."""
    end = int(loop.state.step)
    nonfinite.summarize_skipped(run.config, loop.start, end, loop.skipped, run.ckpts.step_dir(end),
                                stopped=bool(loop.preempted))
    if run.best is not None:
        log.info("%s", run.best.describe(run.ckpts.step_dir(run.best.step) if run.best.step is not None else ""))
    if loop.preempted:
        log.warning("stopped by %s after step %d; checkpoint %s is saved; continue with --config.resume=True",
                    loop.preempted, end, run.ckpts.step_dir(end))
        return TrainResult(results, end, loop.losses, loop.state, loop.preempted)
    if run.evaluator.milestones():
        with saving.lost_process_stops(run.ckpts):
            results["after"] = run.evaluator.after(loop.state, run.writer, loop.canary, trained=loop.start < run.steps)
        run.writer.flush()
        if jax.process_index() == 0:
            storage.write_text(storage.join(run.workdir, "eval.json"), json.dumps(results, indent=2))
    return TrainResult(results, end, loop.losses, loop.state, None)


def restore_or_start(config, ckpts: checkpoint.Checkpoints, state, config_json: dict, fingerprint: dict):
    """(start step, state, data position): the newest readable checkpoint's under config.resume, else (0, state, {}).

    Before its state is read, refuses a checkpoint that lacks what infjax's trainer records, whose LoRA base or
    tokenizer changed, whose config differs in a key that must stay fixed, or whose training data had another
    fingerprint (unless data.resume_if_changed); the checks are training/resume.py's.
    """
    if not config.resume:
        return 0, state, {}

    def refuse_incompatible(step: int, saved: dict) -> None:
        where = ckpts.step_dir(step)
        resume.refuse_other_base(step, saved.get(resume.BASE_KEY), config_json.get(resume.BASE_KEY))
        resume.refuse_other_tokenizer(where, saved, config_json)
        facts = (resume.BASE_KEY, folder_lib.TOKENIZER_KEY)      # what the run read, not config keys
        diffs = config_lib.incompatible_changes({k: v for k, v in saved.items() if k not in facts},
                                                {k: v for k, v in config_json.items() if k not in facts})
        if diffs:
            lines = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, a, b in diffs)
            raise config_lib.ConfigError(f"cannot resume from {where}: the config changed in keys that must stay "
                                         f"fixed for a run:\n{lines}")
        resume.refuse_other_data(where, ckpts.saved_data_position(step), fingerprint, config.data.resume_if_changed)

    start, saved, position = ckpts.restore_newest_readable(checkpoint.abstract_like(state_lib.savable(state)),
                                                           config.checkpoint.fallback, refuse_incompatible)
    state = saved.replace(frozen=state.frozen)
    log.info("resumed from step %d (epoch %d, offset %d) in %s", start, position["epoch"],
             position["offset"], ckpts.directory)
    return start, state, position


def train_loop(run: Run, state, start: int, preemption: Preemption) -> LoopResult:
    """Steps start..steps-1: next batch, step, log, evaluate, stop, save.

    A log line every log_every steps; eval.sets and the canaries at eval.every and at the end (a warning when
    a canary drops); a checkpoint at checkpoint.every, at the end and at a stop, which follows a signal on any
    process at the same step on all.
    """
    config, steps, ckpts, writer, build = run.config, run.steps, run.ckpts, run.writer, run.setup.build
    losses, preempted, canary, skipped = [], None, {}, int(state.skipped)
    tally = console.Tally(build)
    finite = nonfinite.FiniteCheck(config.train.nonfinite == "stop", run.setup.plan, ckpts)
    workers, why = prefetch.choose_workers(build, config.data.step_workers, start, steps)
    stream = prefetch.StepStream(build, start, steps, workers, config.data.prefetch)
    if start < steps:
        log.info("data: %s (%s)", stream.describe(), why)
    with preemption, console.progress(range(start, steps), start, steps,
                                      enabled=jax.process_index() == 0) as progress, stream as step_batches:
        for step in progress:
            built, host_batch, info = next(step_batches)   # the time spent here is the loop waiting for data
            assert built == step, (built, step)
            tally.add(info, host_batch)
            state, metrics = run.train_step(state, mesh_lib.global_batch(host_batch, run.mesh))
            if ckpts.pending is not None:      # a background save that failed stops the run now, not at the next
                saving.poll_saves(ckpts)
            done = step + 1
            finite.queue(step, metrics)        # train.nonfinite=stop: the previous step's flag is read now
            if done % config.log_every == 0 or done == steps:
                finite.check()
                metrics = tally.step_line(done, steps, metrics, state.skipped, stream.waited)
                losses.append((done, metrics["loss"]))
                writer.write({"step": done, **metrics})
                if hasattr(progress, "set_postfix"):
                    progress.set_postfix(loss=f"{metrics['loss']:.4f}")
            best = False
            if run.evaluator.due(done, steps):
                finite.check()
                scores, canary = run.evaluator.at_step(state, done, writer)
                best = run.best is not None and run.best.offer(done, scores)
            preempted = agreed_stop(preemption.received, done, ckpts)
            if done % config.checkpoint.every == 0 or done == steps or preempted or best:
                finite.check()
                if best:
                    ckpts.keep(done)           # kept through rotation (checkpoint.keep_best)
                saving.save_checkpoint(ckpts, done, state, run.position(done), run.config_json)
                writer.flush()                 # object stores: metrics.jsonl rewritten with each checkpoint
            if preempted:
                break
    tally.data_line(start, stream.built, stream.waited)
    return LoopResult(state, losses, preempted, canary if int(state.step) == steps else {}, start,
                      int(state.skipped) - skipped)


def log_lora(encoder, state, base: dict) -> None:
    """The LoRA line: rank, alpha, targets, trainable share of the parameters, the frozen base's dtypes."""
    spec = encoder.lora
    trainable = sum(x.size for x in jax.tree.leaves(state.params))
    frozen = sum(x.size for x in jax.tree.leaves(state.frozen))
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(state.frozen)})
    log.info("LoRA: rank %d, alpha %g (scale %g), dropout %g, on %s; %s trainable parameters (%.2f%% of %s; "
             "the base is frozen, stored as %s, weights %s)", spec.rank, spec.alpha, spec.scale, spec.dropout,
             ",".join(sorted(spec.roles)), f"{trainable:,}", 100 * trainable / max(trainable + frozen, 1),
             f"{trainable + frozen:,}", "/".join(dtypes), base["weights"])


PROG = "python -m infjax.train"


def define_flags(fv: flags.FlagValues) -> None:
    """Every flag of `python -m infjax.train`, into `fv` (`--config.a.b=value` overrides any config key)."""
    cli.define_config(fv, "Config file, e.g. configs/multi_pi.py[:preset]; --config.KEY=VALUE overrides any key "
                          "of it (every key and its default: infjax/config.py).")
    flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, eval.json "
                                         "(default runs/<objective>).", flag_values=fv)


def parse_flags(argv: list[str]) -> flags.FlagValues:
    """The parsed flags, with the config file loaded now.

    A bad flag, config file, preset or config key is one line naming it and exit status 2 (absl alone prints
    tracebacks for most of them). Under the embedded preset, a data.source of one's own trains with the
    defaults, not the synthetic demo's (`config.for_data_source`).
    """
    return cli.parse(PROG, define_flags, argv, doc=__doc__, required=("config",),
                     after=_load_config, catch=cli.CONFIG_ERRORS, message=cli.config_flag_error)


def _load_config(fv: flags.FlagValues) -> None:
    cli.load_config(fv)
    given = [f.name.removeprefix("config.") for f in cli.own_flags(fv) if f.name.startswith("config.") and f.present]
    config_lib.for_data_source(fv.config, given)


def main(argv: list[str] | None = None) -> None:
    fv = parse_flags(sys.argv[1:] if argv is None else argv)
    cli.setup_logging(quiet=("absl",))
    config, workdir = fv.config, fv.workdir or os.path.join("runs", fv.config.objective)
    # One line and exit 2 (bad input), 3 (run stopped), 130 (Ctrl-C); tracebacks only for bugs.
    platform.choose()                  # before JAX starts its backends: the CPU where a plugin has no hardware
    with errors.reported("infjax.train", log):
        # multi-host start-up, before any device is touched; the processes that meet must share config and workdir
        distributed.initialize(job={"config": json.loads(config.to_json_best_effort()),
                                    "workdir": storage.absolute(workdir)})
        if jax.process_index() != 0:   # one process reports progress; the others only warnings and errors
            logging.getLogger("infjax").setLevel(logging.WARNING)
        try:
            run(config, workdir)
            distributed.finished()
        except distributed.ProcessLost as e:   # one line, then out without the runtime's shutdown (it would
            errors.report("infjax.train", e, log)                   # wait for the lost process, then abort)
            distributed.leave(e.exit_code)


if __name__ == "__main__":
    main()
