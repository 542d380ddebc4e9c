"""Train an instruction-following bi-encoder: `python -m infjax.train --config=configs/multi_pi.py`.

    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x
    python -m infjax.train --config=configs/multi_pi.py:e5-base-v2 --config.train.steps=1000
    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x --config.resume=True --config.train.steps=300

Side effects (files, logs, checkpoints) live here; the pieces it wires
together (data, models, losses, training) are pure or near it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

import jax
from absl import app, flags
from ml_collections import config_flags
from tqdm.auto import tqdm

from infjax import config as config_lib
from infjax.data.inf_ir import BadRowError, MissingColumnError
from infjax.evaluation.datasets import DataError
from infjax.evaluation.tasks import evaluate_specs, preload, template_pairs
from infjax.inference.embedders import CrossAttentionQueryEmbedder, TextEmbedder
from infjax.models.encoder import load_encoder, passage_params, query_params
from infjax.training import checkpoint, distributed, mesh as mesh_lib, state as state_lib
from infjax.training.restore import saved_steps
from infjax.training.setup import compiled_train_step, load_training_records, make_batch_setup, make_objective, \
    total_steps

log = logging.getLogger("infjax.train")


def check_resume_request(workdir: str, resume: bool) -> None:
    """Without resume the workdir must not hold an earlier run's checkpoints; with it, it must."""
    ckpt = os.path.join(workdir, "checkpoints")
    has_ckpt = bool(saved_steps(workdir))
    if has_ckpt and not resume:
        raise FileExistsError(f"--workdir={workdir} already holds checkpoints; pass --config.resume=True to "
                              f"continue that run, or choose a new --workdir")
    if resume and not has_ckpt:
        raise FileNotFoundError(f"config.resume=True but {ckpt} holds no checkpoint to resume from")


class NonFiniteError(RuntimeError):
    """A step produced a non-finite loss or gradient under train.nonfinite='stop'."""


class Preemption:
    """SIGTERM / SIGINT set a flag; the loop finishes its step, saves a checkpoint and returns."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):   # noqa: ARG002
        self.received = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class MetricsWriter:
    """Log lines plus one JSON object per logged step in WORKDIR/metrics.jsonl (process 0 only)."""

    def __init__(self, workdir: str):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


SYNTHETIC_SPEC = "synthetic"     # eval.synthetic: the run's own FollowIR-style split (config.data.synthetic)


@dataclasses.dataclass
class TrainResult:
    """What `run` returns."""

    eval: dict                        # {"before": {...}, "after": {...}} of eval.synthetic (as in eval.json)
    final_step: int
    losses: list[tuple[int, float]]   # (step, loss) of every logged step
    state: state_lib.TrainState
    preempted: str | None             # the signal that stopped the run early, else None


class Evaluator:
    """Evaluation of the current parameters on dataset specs (infjax.evaluation.tasks), on the run's mesh.

    The synthetic split of eval.synthetic is one more spec ("synthetic", its keys from
    config.data.synthetic), so in-training evaluation has one path for every dataset.
    """

    def __init__(self, config, encoder, setup, mesh):
        self.config, self.fmt, self.mesh = config, setup.fmt, mesh
        self.synthetic_defaults = config.data.synthetic.to_dict()
        self.embedder = TextEmbedder(encoder, mesh, setup.tokenizer, config.eval.batch_size)
        self.pair_embedder = (CrossAttentionQueryEmbedder(encoder, mesh, setup.tokenizer, setup.fmt,
                                                          config.eval.batch_size)
                              if config.model.interaction == "cross_attention" else None)

    def preload(self, specs: list[str]) -> None:
        """Read the datasets now: a bad file fails before anything compiles."""
        preload(specs, synthetic_defaults=self.synthetic_defaults)

    def __call__(self, state, specs: list[str]) -> dict[str, dict[str, float]]:
        qlen, plen = self.config.data.query_max_len, self.config.data.passage_max_len
        qp, pp = query_params(state.params), passage_params(state.params)
        if self.pair_embedder is not None:           # Interaction II: instruction and query encoded apart
            pairs = lambda i, q: self.pair_embedder(state.params, i, q, qlen)   # noqa: E731
        else:
            pairs = template_pairs(lambda t: self.embedder(qp, t, qlen), self.fmt)
        return evaluate_specs(specs, pairs, lambda t: self.embedder(pp, t, plen), self.fmt,
                              synthetic_defaults=self.synthetic_defaults, mesh=self.mesh)

    def synthetic(self, state) -> dict:
        """eval.json's entry: p-MRR (x100) and nDCG@5 on the synthetic split, and the step."""
        m = self(state, [SYNTHETIC_SPEC])[SYNTHETIC_SPEC]
        return {"p_mrr": m["p_mrr"], "ndcg@5": m["ndcg@5"], "step": int(state.step)}


def restore_or_start(config, ckpts: checkpoint.Checkpoints, state, config_json: dict):
    """(start step, state): the newest readable checkpoint's under config.resume, else (0, state)."""
    if not config.resume:
        return 0, state

    def refuse_incompatible(step: int, saved: dict) -> None:
        diffs = config_lib.incompatible_changes(saved, config_json)
        if diffs:
            lines = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, a, b in diffs)
            raise config_lib.ConfigError(f"cannot resume from {ckpts.step_dir(step)}: the config changed in "
                                         f"keys that must stay fixed for a run:\n{lines}")

    start, state, position = ckpts.restore_newest_readable(checkpoint.abstract_like(state),
                                                           config.checkpoint.fallback, refuse_incompatible)
    log.info("resumed from step %d (epoch %d, offset %d) in %s", start, position["epoch"],
             position["offset"], ckpts.directory)
    return start, state


def run(config, workdir: str) -> TrainResult:
    """Train per `config` in `workdir`: evaluate, train (logging, evaluating, checkpointing), evaluate."""
    config_lib.validate(config, jax.device_count(), jax.process_count())
    log.info("process %d of %d; %d local devices, %d global devices (%s)", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count(), jax.devices()[0].platform)
    check_resume_request(workdir, config.resume)

    # Data and model: files are read here, before anything compiles.
    encoder, params, model_path = load_encoder(config.model)
    records = load_training_records(config.data)
    objective = make_objective(config)
    setup = make_batch_setup(config, records, encoder, model_path, objective)
    steps = total_steps(config, setup.plan)
    log.info("%d records, %d rows per global batch, %d steps per epoch, %d steps", len(records),
             setup.build.global_rows, setup.plan.steps_per_epoch, steps)
    specs = config_lib.eval_specs(config)

    # Mesh, sharded state, compiled step.
    mesh = mesh_lib.make_mesh(config.mesh)
    evaluator = Evaluator(config, encoder, setup, mesh)
    evaluator.preload(specs + ([SYNTHETIC_SPEC] if config.eval.synthetic else []))
    optimizer, schedule = state_lib.make_optimizer(config.train, steps)
    checkpoint.check_writable(workdir, needed_bytes=checkpoint.state_bytes(
        state_lib.abstract_state(params, optimizer, config.train.seed)))
    state, state_sharding = state_lib.create_sharded_state(params, optimizer, config.train.seed, encoder.module, mesh)
    del params
    train_step = compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding)

    config_json = json.loads(config.to_json_best_effort())
    ckpts = checkpoint.Checkpoints(workdir, config.checkpoint.max_to_keep, config.checkpoint.async_save)
    start, state = restore_or_start(config, ckpts, state, config_json)
    if start >= steps:
        log.warning("checkpoint step %d >= train.steps %d: nothing to train", start, steps)

    results = {}
    if config.eval.synthetic:
        results["before"] = evaluator.synthetic(state)
        log.info("eval before training (step %d): p-MRR %+.2f  nDCG@5 %.4f", start,
                 results["before"]["p_mrr"], results["before"]["ndcg@5"])

    try:
        state, losses_seen, preempted = train_loop(config, state, train_step, setup, mesh, ckpts, start, steps,
                                                   MetricsWriter(workdir), specs, evaluator, config_json)
    finally:
        ckpts.close()      # waits for asynchronous saves
    if preempted:
        log.warning("stopped by %s after step %d; checkpoint %s is saved; continue with --config.resume=True",
                    preempted, int(state.step), ckpts.step_dir(int(state.step)))
        return TrainResult(results, int(state.step), losses_seen, state, preempted)

    if config.eval.synthetic:
        results["after"] = evaluator.synthetic(state)
        log.info("eval after training (step %d): p-MRR %+.2f  nDCG@5 %.4f", int(state.step),
                 results["after"]["p_mrr"], results["after"]["ndcg@5"])
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "eval.json"), "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2)
    return TrainResult(results, int(state.step), losses_seen, state, None)


def train_loop(config, state, train_step, setup, mesh, ckpts, start: int, steps: int, writer: MetricsWriter,
               specs: list[str], evaluator: Evaluator, config_json: dict):
    """Steps start..steps-1: log every log_every, evaluate `specs` (eval.sets), checkpoint, stop on a signal.

    Returns (state, [(step, loss)] of the logged steps, the stopping signal's name or None).
    """
    plan, build = setup.plan, setup.build
    losses_seen, preempted = [], None
    t_last, rows_since, skipped_logged = time.perf_counter(), 0, 0
    progress = _progress(range(start, steps), start, steps)
    with Preemption() as preemption:
        for step in progress:
            batch = mesh_lib.global_batch(build(step), mesh)
            state, metrics = train_step(state, batch)
            rows_since += build.global_rows
            done = step + 1
            if config.train.nonfinite == "stop" and not bool(metrics["finite"]):
                pos = plan.position(step)
                raise NonFiniteError(
                    f"non-finite loss or gradient at step {step} (epoch {pos['epoch']}, batch {pos['offset']} "
                    f"of the epoch, records {plan.record_indices(step).tolist()}); the parameters were not "
                    f"updated. Latest checkpoint: {ckpts.latest_step()}. "
                    f"--config.train.nonfinite=skip skips such steps instead.")
            if done % config.log_every == 0 or done == steps:
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                metrics["skipped_steps"] = int(state.skipped)
                now = time.perf_counter()
                metrics["examples_per_s"] = rows_since / (now - t_last)
                t_last, rows_since = now, 0
                losses_seen.append((done, metrics["loss"]))
                log.info("step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.1f examples/s", done, steps,
                         metrics["loss"], metrics["learning_rate"], metrics["grad_norm"],
                         metrics["examples_per_s"])
                if metrics["skipped_steps"] > skipped_logged:
                    log.warning("%d step(s) skipped so far for a non-finite loss or gradient",
                                metrics["skipped_steps"])
                    skipped_logged = metrics["skipped_steps"]
                writer.write({"step": done, **metrics})
                if hasattr(progress, "set_postfix"):
                    progress.set_postfix(loss=f"{metrics['loss']:.4f}")
            if specs and (done == steps or (config.eval.every and done % config.eval.every == 0)):
                scores = evaluator(state, specs)
                log.info("eval at step %d: %s", done, "  ".join(
                    f"{spec} {v['main']:.4f}" for spec, v in scores.items()))
                writer.write({"step": done, "eval": scores})
            preempted = preemption.received or (
                "preemption" if jax.process_count() > 1 and ckpts.reached_preemption(done) else None)
            if done % config.checkpoint.every == 0 or done == steps or preempted:
                ckpts.save(done, state, plan.position(done), config_json)
            if preempted:
                break
    return state, losses_seen, preempted


def _progress(it, start: int, total: int):
    if jax.process_index() != 0:
        return it
    return tqdm(it, initial=start, total=total, desc="train", dynamic_ncols=True, file=sys.stderr)


def main(argv) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
    distributed.initialize()       # multi-host start-up, before any device is touched
    if jax.process_index() != 0:   # one process reports progress; the others only warnings and errors
        logging.getLogger("infjax").setLevel(logging.WARNING)
    try:
        run(config, workdir or os.path.join("runs", config.objective))
    except (config_lib.ConfigError, BadRowError, MissingColumnError, FileNotFoundError, FileExistsError,
            PermissionError, checkpoint.CheckpointReadError, DataError) as e:
        log.error("%s", e)      # a user-facing error: the message names the key, file, row or field
        sys.exit(2)
    except (NonFiniteError, OSError) as e:
        log.error("%s", e)
        sys.exit(3)


def _define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/multi_pi.py[:preset].",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, eval.json "
                                         "(default runs/<objective>).")
    flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
    _define_flags()
    app.run(main)
