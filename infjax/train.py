"""Train an instruction-following bi-encoder: `python -m infjax.train --config=configs/multi_pi.py`.

    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x
    python -m infjax.train --config=configs/multi_pi.py:e5-base-v2 --config.train.steps=1000
    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x --config.resume=True --config.train.steps=300

Side effects (files, logs, checkpoints) live here; the pieces it wires
together (data, models, losses, training) are pure or near it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

import jax
import numpy as np

from infjax import config as config_lib
from infjax import evaluate as evaluate_lib
from infjax import losses
from infjax.data import batches, synthetic
from infjax.data.tokenize import TextFormat, Tokenizer
from infjax.followir import followir_metrics, rerank, rerank_pairs
from infjax.inference import TextEmbedder
from infjax.interaction_inference import CrossAttentionQueryEmbedder
from infjax.models.encoder import load_encoder, passage_params, query_params
from infjax.training.restore import saved_steps
from infjax.training import checkpoint, mesh as mesh_lib, state as state_lib, step as step_lib

log = logging.getLogger("infjax.train")


def load_training_records(data_config, seed: int) -> list[dict]:
    """InF-IR records from the configured source (synthetic, a hub id or local files)."""
    if data_config.source == "synthetic":
        s = data_config.synthetic
        return synthetic.make_synthetic(s.seed, s.num_train, s.num_eval_queries, s.pool_size)[0]
    from infjax.data.inf_ir import LEGACY_FIELD_MAP, DEFAULT_FIELD_MAP, load_inf_ir

    field_map = {"auto": None, "default": DEFAULT_FIELD_MAP, "legacy": LEGACY_FIELD_MAP}[data_config.field_map]
    records = []
    for split in [s.strip() for s in data_config.splits.split(",") if s.strip()]:
        try:
            records += load_inf_ir(data_config.source, split, field_map=field_map,
                                   on_bad_row=data_config.on_bad_row, limit=data_config.limit or None)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"config.data.source={data_config.source!r}: {e}") from e
    return records


def make_objective(config) -> losses.Objective:
    if config.loss.convention == "reference":
        return losses.reference_objective(config.objective, config.loss.temperature)
    return losses.Objective.from_name(config.objective, config.loss.temperature, config.loss.positive_once)


def eval_split(config):
    s = config.data.synthetic
    return synthetic.make_eval_split(s.num_eval_queries, s.seed, s.pool_size, synthetic.split_topics(s.seed)[1])


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


def total_steps(config, plan: batches.BatchPlan) -> int:
    return config.train.steps or config.train.epochs * plan.steps_per_epoch


class MetricsWriter:
    """Log lines plus one JSON object per logged step in WORKDIR/metrics.jsonl (process 0 only)."""

    def __init__(self, workdir: str):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def make_batch_builder(config, records, encoder, model_path: str, objective: losses.Objective):
    """(tokenizer, text format, batch plan, builder of this process's slice of each global batch)."""
    tokenizer = Tokenizer(model_path, padding_side=encoder.padding_side)
    fmt = TextFormat(config.data.query_template, config.data.query_prefix, config.data.passage_prefix)
    plan = batches.BatchPlan(len(records), config.train.batch_size, config.train.seed)
    cross = config.model.interaction == "cross_attention"
    sampler = (batches.InstructionNegativeSampler(records, config.loss.instruction_negatives, config.train.seed)
               if objective.needs_instruction_negatives and not cross else None)
    build = batches.BatchBuilder(records, plan, tokenizer, fmt, config.data.query_max_len,
                                 config.data.passage_max_len, config.data.hard_negatives, sampler,
                                 jax.process_index(), jax.process_count(), config.model.interaction)
    return tokenizer, fmt, plan, build


def compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding):
    """The jitted train step (explicit shardings, donated state), with gradient caching per config."""
    return step_lib.jit_train_step(
        step_lib.make_train_step(encoder, objective, optimizer, schedule, config.model.dropout,
                                 config.train.chunk_size, mesh), mesh, state_sharding)


def run(config, workdir: str) -> dict:
    """Train per `config` in `workdir`.

    Returns {"eval", "final_step", "losses" [(step, loss)], "state", "preempted" (signal name or None)}.
    """
    config_lib.validate(config, jax.device_count(), jax.process_count())
    log.info("process %d of %d; %d local devices, %d global devices (%s)", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count(), jax.devices()[0].platform)
    check_resume_request(workdir, config.resume)

    # Data and model: files are read here, before anything compiles.
    encoder, params, model_path = load_encoder(config.model)
    records = load_training_records(config.data, config.train.seed)
    objective = make_objective(config)
    cross = config.model.interaction == "cross_attention"    # Interaction II: in-batch instruction pairs
    tokenizer, fmt, plan, build = make_batch_builder(config, records, encoder, model_path, objective)
    steps = total_steps(config, plan)
    log.info("%d records, %d rows per global batch, %d steps per epoch, %d steps", len(records),
             build.global_rows, plan.steps_per_epoch, steps)

    # Mesh, sharded state, compiled step.
    mesh = mesh_lib.make_mesh(config.mesh)
    optimizer, schedule = state_lib.make_optimizer(config.train, steps)
    checkpoint.check_writable(workdir, needed_bytes=checkpoint.state_bytes(
        state_lib.abstract_state(params, optimizer, config.train.seed)))
    state, state_sharding = state_lib.create_sharded_state(params, optimizer, config.train.seed, encoder.module, mesh)
    del params
    train_step = compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, state_sharding)

    config_json = json.loads(config.to_json_best_effort())
    ckpts = checkpoint.Checkpoints(workdir, config.checkpoint.max_to_keep, config.checkpoint.async_save)
    start = 0
    if config.resume:
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
    if start >= steps:
        log.warning("checkpoint step %d >= train.steps %d: nothing to train", start, steps)

    # Evaluation before training.
    embedder = TextEmbedder(encoder, mesh, tokenizer, config.eval.batch_size)
    split = eval_split(config) if config.eval.synthetic else None
    pair_embedder = CrossAttentionQueryEmbedder(encoder, mesh, tokenizer, fmt, config.eval.batch_size) \
        if cross else None

    def evaluate(st) -> dict:
        qp, pp = query_params(st.params), passage_params(st.params)
        embed_passage = lambda t: embedder(pp, t, config.data.passage_max_len)   # noqa: E731
        if cross:
            runs = rerank_pairs(split, lambda i, q: pair_embedder(st.params, i, q, config.data.query_max_len),
                                embed_passage, fmt)
        else:
            runs = rerank(split, lambda t: embedder(qp, t, config.data.query_max_len), embed_passage, fmt)
        return dict(followir_metrics(split, *runs), step=int(st.step))

    specs = config_lib.eval_specs(config)
    if specs:
        evaluate_lib.preload(specs, synthetic_defaults=config.data.synthetic.to_dict())

    def evaluate_sets(st) -> dict:
        qp, pp = query_params(st.params), passage_params(st.params)
        pairs = (lambda i, q: pair_embedder(st.params, i, q, config.data.query_max_len)) if cross else None
        return evaluate_lib.evaluate_during_training(
            specs, lambda t: embedder(qp, t, config.data.query_max_len),
            lambda t: embedder(pp, t, config.data.passage_max_len), fmt, embed_pairs=pairs,
            synthetic_defaults=config.data.synthetic.to_dict(), mesh=mesh)

    results = {}
    if split is not None:
        results["before"] = evaluate(state)
        log.info("eval before training (step %d): p-MRR %+.2f  nDCG@5 %.4f", start,
                 results["before"]["p_mrr"], results["before"]["ndcg@5"])

    writer = MetricsWriter(workdir)
    losses_seen, preempted = [], None
    t_last, rows_since, skipped_logged = time.perf_counter(), 0, 0
    progress = _progress(range(start, steps), start, steps)
    try:
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
                    scores = evaluate_sets(state)
                    log.info("eval at step %d: %s", done, "  ".join(
                        f"{spec} {v['main']:.4f}" for spec, v in scores.items()))
                    writer.write({"step": done, "eval": scores})
                preempted = preemption.received or (
                    "preemption" if jax.process_count() > 1 and ckpts.reached_preemption(done) else None)
                if done % config.checkpoint.every == 0 or done == steps or preempted:
                    ckpts.save(done, state, plan.position(done), config_json)
                if preempted:
                    break
    finally:
        ckpts.close()      # waits for asynchronous saves
    if preempted:
        log.warning("stopped by %s after step %d; checkpoint %s is saved; continue with --config.resume=True",
                    preempted, int(state.step), ckpts.step_dir(int(state.step)))
        return {"eval": results, "final_step": int(state.step), "losses": losses_seen, "state": state,
                "preempted": preempted}

    if split is not None:
        results["after"] = evaluate(state)
        log.info("eval after training (step %d): p-MRR %+.2f  nDCG@5 %.4f", int(state.step),
                 results["after"]["p_mrr"], results["after"]["ndcg@5"])
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "eval.json"), "w", encoding="utf-8") as f:
                json.dump(results, f, indent=2)
    return {"eval": results, "final_step": int(state.step), "losses": losses_seen, "state": state,
            "preempted": None}


def _progress(it, start: int, total: int):
    if jax.process_index() != 0:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, initial=start, total=total, desc="train", dynamic_ncols=True, file=sys.stderr)


def main(argv) -> None:
    from absl import flags

    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
    from infjax.training import distributed

    distributed.initialize()       # multi-host start-up, before any device is touched
    if jax.process_index() != 0:   # one process reports progress; the others only warnings and errors
        logging.getLogger("infjax").setLevel(logging.WARNING)
    from infjax.data.inf_ir import BadRowError, MissingColumnError

    try:
        run(config, workdir or os.path.join("runs", config.objective))
    except (config_lib.ConfigError, BadRowError, MissingColumnError, FileNotFoundError, FileExistsError,
            PermissionError, checkpoint.CheckpointReadError, evaluate_lib.DataError) as e:
        log.error("%s", e)      # a user-facing error: the message names the key, file, row or field
        sys.exit(2)
    except (NonFiniteError, OSError) as e:
        log.error("%s", e)
        sys.exit(3)


def _define_flags() -> None:
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/multi_pi.py[:preset].",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, eval.json "
                                         "(default runs/<objective>).")
    flags.mark_flags_as_required(["config"])


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main)
