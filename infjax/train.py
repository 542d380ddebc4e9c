"""Train an instruction-following bi-encoder: `python -m infjax.train --config=configs/multi_pi.py`.

    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x
    python -m infjax.train --config=configs/multi_pi.py:e5-base-v2 --config.train.steps=1000
    python -m infjax.train --config=configs/multi_pi.py --workdir=runs/x --config.resume=True --config.train.steps=300

Side effects (files, logs, checkpoints) live here; the pieces it wires
together (data, models, losses, training) are pure or near it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import NamedTuple

if __name__ == "__main__":   # glibc reads its tunables once, at start: restart before the heavy imports
    from infjax.runtime.cpu import restart_with_huge_pages
    restart_with_huge_pages()

import jax
from absl import flags

from infjax import cli, config as config_lib, errors
from infjax.data import prefetch
from infjax.data.batches import real_tokens
from infjax.evaluation.canary import CanaryWatch, describe_drop
from infjax.evaluation.tasks import evaluate_specs, preload, template_pairs
from infjax.inference.embedders import CrossAttentionQueryEmbedder, TextEmbedder
from infjax.models import folder as folder_lib, remat as remat_lib
from infjax.models.encoder import load_encoder, passage_params, query_params
from infjax.models.hf import files as hf_files
from infjax.runtime import checkpoint, distributed, cpu as runtime_cpu, mesh as mesh_lib, platform, storage
from infjax.training import console, state as state_lib, workdir as workdir_lib, writers as writers_lib
from infjax.runtime.restore import saved_steps
from infjax.training.setup import TrainingData, abstract_global_batch, compiled_train_step, make_batch_setup, \
    make_objective, open_training_data, total_steps, widest_step

log = logging.getLogger("infjax.train")


def check_resume_request(workdir: str, resume: bool) -> None:
    """Without resume the workdir must not hold an earlier run's checkpoints; with it, it must."""
    ckpt = storage.join(workdir, "checkpoints")
    has_ckpt = bool(saved_steps(workdir))
    if has_ckpt and not resume:
        raise FileExistsError(f"--workdir={workdir} already holds checkpoints; pass --config.resume=True to "
                              f"continue that run, or choose a new --workdir")
    if resume and not has_ckpt:
        raise FileNotFoundError(f"config.resume=True but {ckpt} holds no checkpoint to resume from")


class NonFiniteError(errors.RunStopped):
    """A step produced a non-finite loss, gradient or update under train.nonfinite='stop'."""


class MostStepsSkipped(errors.RunStopped):
    """More of the run's steps than train.max_skipped allows were skipped as non-finite: it did not train."""


class CheckpointSaveError(errors.RunStopped):
    """A checkpoint could not be written (e.g. the disk is full); the message names the last complete one."""


class RunFilesError(errors.RunStopped):
    """A file of the run (metrics.jsonl, eval.json) could not be written: a full disk, a failing device."""


class Preemption:
    """SIGTERM / SIGINT / SIGHUP set a flag; the loop finishes its step, saves a checkpoint and returns. SIGHUP is
    a closed terminal or SSH session: the standard streams it took away (where every write now fails) are sent
    to /dev/null first (`errors.drop_hung_up_streams`). A run started under `nohup` (SIGHUP ignored) or as a
    shell's background job (SIGINT ignored) keeps that signal ignored (`errors.catch`).

    The flag is this process's: with several processes, `agreed_stop` turns a signal on any of them into
    one step at which all stop. The signal also starts a clock: a run that has not left this block
    `grace_s` seconds later (held in a write, a save or a wait that does not end) exits without its
    checkpoint, status 128 + the signal, with one line saying where it was held and `expired()`'s text
    (the checkpoint to resume from); the clock runs until `disarm()`, through the last save after the loop.
    A second signal inside the block exits the same way at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, grace_s: float = 0.0, expired=lambda: ""):
        self.received: str | None = None
        self.grace_s, self._expired = grace_s, expired
        self._previous = {}
        self._left = threading.Event()
        self._main = threading.main_thread().ident

    def _handle(self, signum, frame):
        if signum == signal.SIGHUP:
            errors.drop_hung_up_streams()
        if self.received is not None:
            self._exit(signum, f"stopped by a second {signal.Signals(signum).name}", frame)
        self.received = signal.Signals(signum).name
        if self.grace_s > 0:
            threading.Thread(target=self._watch, args=(signum,), name="infjax-stop-watch", daemon=True).start()

    def _watch(self, signum: int) -> None:
        if not self._left.wait(self.grace_s):
            self._exit(signum, f"stopped by {signal.Signals(signum).name}, but the run did not reach its checkpoint "
                               f"within train.stop_grace_s={self.grace_s:g} s")

    def _exit(self, signum: int, why: str, frame=None) -> None:
        log.error("%s (held %s); exiting without saving; %s", why, held_at(self._main, frame), self._expired())
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os._exit(128 + signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = errors.catch(self.SIGNALS, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self.received is None:
            self.disarm()
        return False        # after a signal the clock runs on: the save and the close after the loop are bounded

    def disarm(self) -> None:
        """The run is over (it returns or raises): the clock of a signal stops."""
        self._left.set()


def held_at(thread_id: int, frame=None) -> str:
    """Where thread `thread_id` is now (or `frame`, where a signal handler interrupted it): its innermost call and,
    when that is a library's, infjax's call into it."""
    frame = frame or sys._current_frames().get(thread_id)   # noqa: SLF001 - the documented way to see a thread
    if frame is None:
        return "nowhere (the thread ended)"
    stack = traceback.extract_stack(frame)

    def short(f) -> str:
        path = f.filename.replace("\\", "/")
        if "/site-packages/" in path:
            path = path.rsplit("/site-packages/", 1)[1]
        elif "/infjax/" in path:
            path = "infjax/" + path.rsplit("/infjax/", 1)[1]
        else:
            path = os.path.basename(path)
        return f"{f.name} ({path}:{f.lineno})"

    inner = stack[-1]
    ours = next((f for f in reversed(stack) if "/infjax/" in f.filename.replace("\\", "/")), None)
    return f"in {short(inner)}" + (f", called from {short(ours)}" if ours is not None and ours is not inner else "")


def agreed_stop(received: str | None, step: int, ckpts: checkpoint.Checkpoints) -> str | None:
    """Whether to stop after `step`: the name of the signal received by any process (all processes
    agree, so they save the same checkpoint and exit together), or "preemption" when JAX's preemption
    notice reached its sync point; else None. Every process calls this after every step."""
    if jax.process_count() == 1:
        return received
    code = distributed.max_over_processes(int(signal.Signals[received]) if received else 0)
    if code:
        return signal.Signals(code).name
    return "preemption" if ckpts.reached_preemption(step) else None


SYNTHETIC_SET = "synthetic"     # eval.synthetic: the run's own FollowIR-style split (config.data.synthetic)


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

    def __call__(self, state, specs: list[str]) -> dict[str, dict[str, float]]:
        qlen, plen = self.config.data.query_max_len, self.config.data.passage_max_len
        params = state.model_params
        qp, pp = query_params(params), passage_params(params)
        if self.pair_embedder is not None:           # Interaction II: instruction and query encoded apart
            pairs = lambda i, q: self.pair_embedder(params, i, q, qlen)   # noqa: E731
        else:
            pairs = template_pairs(lambda t: self.embedder(qp, t, qlen), self.fmt)
        return evaluate_specs(specs, pairs, lambda t: self.embedder(pp, t, plen), self.fmt,
                              synthetic_defaults=self.synthetic_defaults, mesh=self.mesh)

    def synthetic(self, state) -> dict:
        """eval.json's entry: p-MRR (x100) and nDCG@5 on the synthetic split, and the step."""
        m = self(state, [SYNTHETIC_SET])[SYNTHETIC_SET]
        return {"p_mrr": m["p_mrr"], "ndcg@5": m["ndcg@5"], "step": int(state.step)}

    def milestone(self, state, canaries: list[str], watch: CanaryWatch, writer, known: dict | None = None) -> dict:
        """eval.json's "before" / "after" entry: the synthetic split (eval.synthetic) and the canaries.

        `known`: canary scores already computed at this step (the loop's last evaluation), not recomputed."""
        out = self.synthetic(state) if self.config.eval.synthetic else {"step": int(state.step)}
        if canaries:
            scores = dict(known or {})
            missing = [c for c in canaries if c not in scores]
            if missing:
                scores.update(self(state, missing))
                check_canaries(watch, int(state.step), {c: scores[c] for c in missing}, writer)
            out["canary"] = {c: scores[c] for c in canaries}
        return out


def check_canaries(watch: CanaryWatch, step: int, scores: dict, writer) -> None:
    """Log and write (metrics.jsonl) a warning for each canary that dropped by more than its margin."""
    for w in watch.update(step, scores):
        log.warning("%s", describe_drop(w))
        writer.write(w)


def describe_milestone(entry: dict) -> str:
    parts = []
    if "p_mrr" in entry:
        parts.append(f"p-MRR {entry['p_mrr']:+.2f}  nDCG@5 {entry['ndcg@5']:.4f}")
    for spec, m in entry.get("canary", {}).items():
        parts.append(f"canary {spec} {m['main']:.4f}")
    return "  ".join(parts)


def restore_or_start(config, ckpts: checkpoint.Checkpoints, state, config_json: dict, fingerprint: dict):
    """(start step, state): the newest readable checkpoint's under config.resume, else (0, state).

    Refuses a checkpoint whose config differs in a key that must stay fixed, whose base folder now holds
    another tokenizer, or whose training data had another fingerprint (unless data.resume_if_changed), before
    its state is read."""
    if not config.resume:
        return 0, state

    def refuse_incompatible(step: int, saved: dict) -> None:
        refuse_other_base(step, saved.get(BASE_KEY), config_json.get(BASE_KEY))
        key = folder_lib.TOKENIZER_KEY
        other = folder_lib.other_tokenizer(saved.get(key), config_json.get(key))
        if other:
            raise config_lib.ConfigError(f"cannot resume from {ckpts.step_dir(step)}: {other}")
        if key not in saved:
            log.info("checkpoint %s records no tokenizer (an older run): the tokenizer is not checked",
                     ckpts.step_dir(step))
        facts = (BASE_KEY, folder_lib.TOKENIZER_KEY)      # what the run read, not config keys
        diffs = config_lib.incompatible_changes({k: v for k, v in saved.items() if k not in facts},
                                                {k: v for k, v in config_json.items() if k not in facts})
        if diffs:
            lines = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, a, b in diffs)
            raise config_lib.ConfigError(f"cannot resume from {ckpts.step_dir(step)}: the config changed in "
                                         f"keys that must stay fixed for a run:\n{lines}")
        saved_fp = ckpts.saved_data_position(step).get("data_fingerprint")
        if saved_fp is None:
            log.info("checkpoint %s stores no data fingerprint (an older run): the data is not checked",
                     ckpts.step_dir(step))
        elif saved_fp.get("of") != fingerprint.get("of"):
            if saved_fp.get("records") != fingerprint["records"] and not config.data.resume_if_changed:
                raise config_lib.ConfigError(
                    f"cannot resume from {ckpts.step_dir(step)}: the training data changed since it was saved (then "
                    f"{saved_fp.get('records')} records, now {fingerprint['records']}); restore the data, or pass "
                    f"--config.data.resume_if_changed=True to go on with the new data")
            log.info("checkpoint %s's data fingerprint was computed by an older infjax: only the record count "
                     "(%d) is compared", ckpts.step_dir(step), fingerprint["records"])
        elif saved_fp != fingerprint:
            if not config.data.resume_if_changed:
                raise config_lib.ConfigError(
                    f"cannot resume from {ckpts.step_dir(step)}: the training data changed since it was saved "
                    f"(then {saved_fp['records']} records, hash {saved_fp['hash']}; now {fingerprint['records']} "
                    f"records, hash {fingerprint['hash']}), so the batches of the remaining steps would differ; "
                    f"restore the data, or pass --config.data.resume_if_changed=True to go on with the new data")
            log.warning("resuming on changed training data (%s -> %s) as data.resume_if_changed asks",
                        saved_fp, fingerprint)

    start, saved, position = ckpts.restore_newest_readable(checkpoint.abstract_like(state_lib.savable(state)),
                                                           config.checkpoint.fallback, refuse_incompatible)
    state = saved.replace(frozen=state.frozen)
    log.info("resumed from step %d (epoch %d, offset %d) in %s", start, position["epoch"],
             position["offset"], ckpts.directory)
    return start, state


def note_schedule_change(config, ckpts: checkpoint.Checkpoints, start: int, steps: int) -> None:
    """A run continued with another length (train.steps, or epochs over data of another size) follows the
    learning-rate schedule of its new length from the checkpoint on, so that it still decays to its end: one line
    says so, with the rate at the checkpoint's step on both schedules."""
    position = ckpts.saved_data_position(start)
    saved = position.get("schedule_steps")
    if saved is None:                      # a checkpoint that predates the key: its config's train.steps
        saved = int(ckpts.saved_config(start).get("train", {}).get("steps") or 0) or None
    if saved is None or saved == steps:
        return
    rate = lambda total: float(state_lib.learning_rate_schedule(   # noqa: E731
        config.train.learning_rate, total, config.train.warmup_steps)(start))
    log.warning("the learning-rate schedule changed: the run now has %d steps where checkpoint %d's had %d, so from "
                "step %d it follows the %d-step schedule (learning rate %.3g at step %d, where the %d-step one had "
                "%.3g)", steps, start, saved, start, steps, rate(steps), start, saved, rate(saved))


BASE_KEY = "base_model"     # config.json of a LoRA run's checkpoints: {"checkpoint", "weights"} of its base


def base_identity(checkpoint_name: str, path: str) -> dict:
    """What a LoRA run's adapters belong to: model.checkpoint and a hash of its weight files."""
    return {"checkpoint": checkpoint_name, "weights": hf_files.weights_digest(path)}


def refuse_other_base(step: int, saved: dict | None, current: dict | None) -> None:
    """Adapters trained on one base are meaningless on another: refuse, naming both."""
    if saved is not None and current is not None and saved["weights"] != current["weights"]:
        raise config_lib.ConfigError(
            f"cannot resume from checkpoint {step}: its LoRA adapters were trained on {saved['checkpoint']} "
            f"(weights {saved['weights']}), but model.checkpoint={current['checkpoint']} has weights "
            f"{current['weights']}; resume with the base the run started from")


def log_lora(encoder, state, base: dict) -> None:
    spec = encoder.lora
    trainable = sum(x.size for x in jax.tree.leaves(state.params))
    frozen = sum(x.size for x in jax.tree.leaves(state.frozen))
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(state.frozen)})
    log.info("LoRA: rank %d, alpha %g (scale %g), dropout %g, on %s; %s trainable parameters (%.2f%% of %s; "
             "the base is frozen, stored as %s, weights %s)", spec.rank, spec.alpha, spec.scale, spec.dropout,
             ",".join(sorted(spec.roles)), f"{trainable:,}", 100 * trainable / max(trainable + frozen, 1),
             f"{trainable + frozen:,}", "/".join(dtypes), base["weights"])


def run(config, workdir: str) -> TrainResult:
    """Train per `config` in `workdir`: evaluate, train (logging, evaluating, checkpointing), evaluate.

    The workdir is locked for the run (one run per workdir; process 0 holds the lock). Every path of the run
    derives from one root: `workdir` made absolute with `~` expanded (`--workdir=~/x` reaches the shell
    unexpanded), or the URL of an object store. Several processes start together or not at all: one that
    cannot start (its config, its files) stops the others before their first collective."""
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
            check_resume_request(workdir, config.resume)
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
    return RunInputs(encoder, params, model_path, data, data.fingerprint, make_objective(config), specs, canaries)


def _run(config, workdir: str, inputs: RunInputs) -> TrainResult:
    encoder, params, model_path, data, fingerprint, objective, specs, canaries = inputs
    del inputs
    setup = make_batch_setup(config, data, encoder, model_path, objective)
    steps = total_steps(config, setup.plan)
    log.info("%d records, %d rows per global batch, %d steps per epoch, %d steps", len(data.store),
             setup.build.global_rows, setup.plan.steps_per_epoch, steps)
    log.info("%s", describe_data_cuts(setup.build.data_cuts(), config.data))

    # Mesh, sharded state, compiled step.
    mesh = mesh_lib.make_mesh(config.mesh)
    evaluator = Evaluator(config, encoder, setup, mesh)
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
        config_json[BASE_KEY] = base_identity(config.model.checkpoint, model_path)
        log_lora(encoder, state, config_json[BASE_KEY])
    ckpts = checkpoint.Checkpoints(workdir, config.checkpoint.max_to_keep, config.checkpoint.async_save)
    distributed.on_lost(lambda cause: str(lost_error(ckpts, cause)))   # the peer watcher's last line
    metrics_log = writers_lib.Writers(workdir, writers_lib.writer_names(config.log.writers), config_json,
                                      enabled=jax.process_index() == 0)
    try:                   # the views (TensorBoard) are closed on every path
        return _train(config, workdir, state, train_step, setup, mesh, ckpts, steps, metrics_log, specs,
                      evaluator, config_json, fingerprint, canaries)
    finally:
        metrics_log.close()


CUT_SIDES = {"q": ("queries", "query"), "i": ("instructions", "query"), "qo": ("queries", "query"),
             "p": ("passages", "passage")}


def describe_data_cuts(cuts: dict[str, tuple[int, int]], data) -> str:
    """The line of `BatchBuilder.data_cuts`: "data: texts cut at their max length: 0 of 96 queries at
    data.query_max_len=256 tokens, 12 of 96 passages (12.5%) at data.passage_max_len=512 tokens"."""
    def side(name: str) -> str:
        (cut, n), (texts, key) = cuts[name], CUT_SIDES[name]
        share = f" ({100 * cut / n:.1f}%)" if cut and n else ""
        return f"{cut} of {n} {texts}{share} at data.{key}_max_len={data[f'{key}_max_len']} tokens"
    return "data: texts cut at their max length: " + ", ".join(side(s) for s in CUT_SIDES if s in cuts)


def _train(config, workdir, state, train_step, setup, mesh, ckpts, steps, metrics_log, specs, evaluator,
           config_json, fingerprint, canaries) -> TrainResult:
    """Restore or start, evaluate before, train, evaluate after; eval.json."""
    preemption = Preemption(config.train.stop_grace_s, lambda: last_complete(ckpts))
    try:
        return _train_until_stopped(config, workdir, state, train_step, setup, mesh, ckpts, steps, metrics_log,
                                    specs, evaluator, config_json, fingerprint, canaries, preemption)
    finally:
        preemption.disarm()


def _train_until_stopped(config, workdir, state, train_step, setup, mesh, ckpts, steps, metrics_log, specs,
                         evaluator, config_json, fingerprint, canaries, preemption) -> TrainResult:
    lost = False
    try:                   # the manager is closed on every path (else its threads report errors at exit) ...
        with lost_process_stops(ckpts):
            start, state = restore_or_start(config, ckpts, state, config_json, fingerprint)
            if start:
                note_schedule_change(config, ckpts, start, steps)
            skipped_at_start = int(state.skipped)
            if start >= steps:
                log.warning("checkpoint step %d >= train.steps %d: nothing to train", start, steps)
            metrics_log.start(start)

            results, watch = {}, CanaryWatch(config.eval.canary_margin)
            if config.eval.synthetic or canaries:
                t0 = time.perf_counter()
                results["before"] = evaluator.milestone(state, canaries, watch, metrics_log)
                metrics_log.view({"step": start, "eval": milestone_sets(results["before"])})
                log.info("eval before training (step %d, %.1f s): %s", start, time.perf_counter() - t0,
                         describe_milestone(results["before"]))
            state, losses_seen, preempted, last_eval = train_loop(
                config, state, train_step, setup, mesh, ckpts, start, steps, metrics_log, specs, evaluator,
                config_json, fingerprint, canaries, watch, preemption)
            close_checkpoints(ckpts, workdir)  # waits for asynchronous saves
    except distributed.ProcessLost:
        lost = True                            # ... but when another process is gone: closing would wait for it
        raise
    except OSError as e:
        if e.errno not in errors.DEVICE_ERRNOS:
            raise
        raise RunFilesError(f"{errors.describe(e)}; {last_complete(ckpts, ' once there is room')}") from e
    finally:
        if not lost:
            close_checkpoints(ckpts, workdir, quiet=True)
        metrics_log.flush()                    # object stores: the records not yet written
    summarize_skipped(config, start, int(state.step), int(state.skipped) - skipped_at_start,
                      ckpts.step_dir(int(state.step)), stopped=bool(preempted))
    if preempted:
        log.warning("stopped by %s after step %d; checkpoint %s is saved; continue with --config.resume=True",
                    preempted, int(state.step), ckpts.step_dir(int(state.step)))
        return TrainResult(results, int(state.step), losses_seen, state, preempted)

    if config.eval.synthetic or canaries:
        t0 = time.perf_counter()
        with lost_process_stops(ckpts):
            results["after"] = evaluator.milestone(state, canaries, watch, metrics_log, known=last_eval)
        in_loop = set(specs) | set(canaries) if start < steps else set()   # the loop's last evaluation wrote these
        metrics_log.view({"step": int(state.step), "eval": {k: v for k, v in milestone_sets(results["after"]).items()
                                                            if k not in in_loop}})
        log.info("eval after training (step %d, %.1f s): %s", int(state.step), time.perf_counter() - t0,
                 describe_milestone(results["after"]))
        metrics_log.flush()
        if jax.process_index() == 0:
            storage.write_text(storage.join(workdir, "eval.json"), json.dumps(results, indent=2))
    return TrainResult(results, int(state.step), losses_seen, state, None)


@contextlib.contextmanager
def lost_process_stops(ckpts: checkpoint.Checkpoints):
    """Inside: the error of a collective or barrier whose peer process is gone (killed, crashed) becomes one
    line, ProcessLost, naming the last complete checkpoint (before: a traceback, then a C++ dump at exit)."""
    try:
        yield
    except distributed.ProcessLost:
        raise
    except Exception as e:  # noqa: BLE001 - only a lost process is reworded; anything else goes up as it is
        cause = distributed.lost_process(e)
        if cause is None:
            raise
        raise lost_error(ckpts, cause) from e


def lost_error(ckpts: checkpoint.Checkpoints, cause: str) -> distributed.ProcessLost:
    return distributed.ProcessLost(f"another process of this job stopped ({cause}), so this one stops too; "
                                   f"{last_complete(ckpts)}")


def last_complete(ckpts: checkpoint.Checkpoints, when: str = "") -> str:
    """Which checkpoint a run that stops leaves to resume from, read from the files (no collective)."""
    last = ckpts.complete_steps()
    if not last:
        return "no checkpoint of this run is complete"
    return (f"the last complete checkpoint is {ckpts.step_dir(last[-1])} (resume from it with "
            f"--config.resume=True{when})")


def summarize_skipped(config, start: int, end: int, skipped: int, checkpoint_dir: str, stopped: bool) -> None:
    """The end-of-run line on non-finite steps: how many of this run's steps (start+1..end) were skipped.
    A finished run that skipped more than train.max_skipped of them did not train, whatever its last line
    says: it stops with MostStepsSkipped (exit status 3), its last checkpoint kept as it is. A run stopped by a
    signal only reports (its resume goes on)."""
    trained = end - start
    if trained <= 0:
        return
    share = skipped / trained
    line = (f"steps {start + 1}-{end}: {skipped} of {trained} skipped as non-finite (loss, gradient or update NaN "
            f"or inf; the parameters were not updated by them)")
    if stopped or share <= config.train.max_skipped:
        (log.warning if skipped else log.info)("%s", line)
        return
    raise MostStepsSkipped(
        f"{line}: {share:.0%} of the run, more than train.max_skipped={config.train.max_skipped:g}, so the model "
        f"did not train. Checkpoint {checkpoint_dir} is kept as it is. Lower train.learning_rate (now "
        f"{config.train.learning_rate:g}) and start again; --config.train.nonfinite=stop stops at the first such step")


def milestone_sets(entry: dict) -> dict:
    """An eval.json entry as {set: metrics}: the synthetic split (p-MRR, nDCG@5) and the canaries."""
    synthetic = {SYNTHETIC_SET: {k: entry[k] for k in ("p_mrr", "ndcg@5")}} if "p_mrr" in entry else {}
    return {**synthetic, **entry.get("canary", {})}


def train_loop(config, state, train_step, setup, mesh, ckpts, start: int, steps: int,
               writer: writers_lib.Writers, specs: list[str], evaluator: Evaluator, config_json: dict,
               fingerprint: dict, canaries: list[str] = (), watch: CanaryWatch | None = None,
               preemption: Preemption | None = None) -> LoopResult:
    """Steps start..steps-1: log every log_every, evaluate `specs` (eval.sets) and the canaries at
    eval.every and at the end (warning when a canary drops), checkpoint, stop on a signal.
    """
    plan, build = setup.plan, setup.build
    losses_seen, preempted, last_canary = [], None, {}
    watch = watch or CanaryWatch(config.eval.canary_margin)
    evaluated = list(dict.fromkeys([*specs, *canaries]))
    t_last, rows_since, tokens_since, skipped_logged = time.perf_counter(), 0, 0, 0
    # train.nonfinite=stop: a step's `finite` flag is read once the next step is queued (or before a log
    # line, an evaluation or a checkpoint), so the host never waits on the step it just dispatched.
    unchecked: list[tuple[int, jax.Array]] = []

    def check_finite():
        for checked_step, finite in unchecked:
            if not bool(finite):
                pos = plan.position(checked_step)
                raise NonFiniteError(
                    f"non-finite loss, gradient or updated parameters at step {checked_step} (epoch {pos['epoch']}, "
                    f"batch {pos['offset']} of the epoch, records {plan.record_indices(checked_step).tolist()}); "
                    f"the parameters were not updated. Latest checkpoint: {ckpts.latest_step()}. "
                    f"--config.train.nonfinite=skip skips such steps instead.")
        unchecked.clear()

    workers, why = prefetch.choose_workers(build, config.data.step_workers, start, steps)
    stream = prefetch.StepStream(build, start, steps, workers, config.data.prefetch)
    if start < steps:
        log.info("data: %s (%s)", stream.describe(), why)
    cut, texts, grown, waited_at_log = {}, {}, set(), 0.0
    with preemption or Preemption() as preemption, console.progress(range(start, steps), start, steps,
                                                      enabled=jax.process_index() == 0) as progress, \
            stream as step_batches:
        for step in progress:
            built, host_batch, info = next(step_batches)   # the time spent here is the loop waiting for data
            assert built == step, (built, step)
            for side, n in info["texts"].items():
                texts[side] = texts.get(side, 0) + n
            for side, n in info["cut"].items():
                cut[side] = cut.get(side, 0) + n
            if info["grown"] is not None and info["grown"] not in grown:
                log.warning("%s", info["grown"])
                grown.add(info["grown"])
            tokens_since += real_tokens(host_batch)    # this process's rows, counted on the host: no device sync
            state, metrics = train_step(state, mesh_lib.global_batch(host_batch, mesh))
            rows_since += build.global_rows
            if ckpts.pending is not None:      # a background save that failed stops the run now, not at the next
                poll_saves(ckpts)
            done = step + 1
            if config.train.nonfinite == "stop":
                check_finite()                 # the previous step's flag: it ran before this one
                unchecked.append((step, metrics["finite"]))
            if done % config.log_every == 0 or done == steps:
                check_finite()
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                metrics["skipped_steps"] = int(state.skipped)
                now = time.perf_counter()
                metrics["examples_per_s"] = rows_since / (now - t_last)
                metrics["real_tokens_per_s"] = distributed.sum_over_processes(tokens_since) / (now - t_last)
                metrics["data_wait_share"] = (stream.waited - waited_at_log) / (now - t_last)
                t_last, rows_since, tokens_since, waited_at_log = now, 0, 0, stream.waited
                losses_seen.append((done, metrics["loss"]))
                log.info("step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.1f examples/s  %.0f real tokens/s  "
                         "data wait %.0f%%", done, steps, metrics["loss"], metrics["learning_rate"],
                         metrics["grad_norm"], metrics["examples_per_s"], metrics["real_tokens_per_s"],
                         100 * metrics["data_wait_share"])
                if metrics["skipped_steps"] > skipped_logged:
                    log.warning("%d step(s) skipped so far for a non-finite loss or gradient",
                                metrics["skipped_steps"])
                    skipped_logged = metrics["skipped_steps"]
                writer.write({"step": done, **metrics})
                if hasattr(progress, "set_postfix"):
                    progress.set_postfix(loss=f"{metrics['loss']:.4f}")
            if evaluated and (done == steps or (config.eval.every and done % config.eval.every == 0)):
                check_finite()
                t0 = time.perf_counter()
                scores = evaluator(state, evaluated)
                log.info("eval at step %d (%.1f s): %s", done, time.perf_counter() - t0, "  ".join(
                    f"{spec} {v['main']:.4f}" for spec, v in scores.items()))
                writer.write({"step": done, "eval": scores})
                last_canary = {c: scores[c] for c in canaries}
                check_canaries(watch, done, last_canary, writer)
            preempted = agreed_stop(preemption.received, done, ckpts)
            if done % config.checkpoint.every == 0 or done == steps or preempted:
                check_finite()
                save_checkpoint(ckpts, done, state, {**plan.position(done), "data_fingerprint": fingerprint,
                                                     "schedule_steps": steps}, config_json)
                writer.flush()                 # object stores: metrics.jsonl rewritten with each checkpoint
            if preempted:
                break
    if stream.built:
        whose = "texts" if jax.process_count() == 1 else "this process's texts"
        cuts = ", ".join(f"{side} {cut[side]} of {texts[side]} ({100 * cut[side] / max(texts[side], 1):.1f}%, at "
                         f"{build.max_len(side)} tokens)" for side in sorted(cut))
        log.info("data: steps %d-%d waited %.1f s for their batches in all%s", start + 1, start + stream.built,
                 stream.waited, f"; {whose} cut at their max length: {cuts}" if cuts else "")
    return LoopResult(state, losses_seen, preempted, last_canary if int(state.step) == steps else {})


def save_checkpoint(ckpts: checkpoint.Checkpoints, step: int, state, position: dict, config_json: dict) -> None:
    """Save (asynchronously by default). Too little free disk for one more checkpoint, or a failed write
    (this one's or the previous asynchronous one's), stops the run with one message naming the last
    complete checkpoint."""
    try:
        ckpts.finish()     # the previous save must land before free space means anything (Orbax waits anyway)
    except Exception as e:  # noqa: BLE001 - it failed: say so, with its own message
        raise _save_failed(ckpts, ckpts.pending, e) from e
    state = state_lib.savable(state)      # LoRA: the adapters and their moments; the base is its own checkpoint
    needed, free = checkpoint.state_bytes(state), checkpoint.free_bytes(ckpts.directory)
    if free < needed:
        raise CheckpointSaveError(
            f"cannot save checkpoint {step} in {ckpts.directory}: {errors.byte_size(free)} free on its disk, one "
            f"checkpoint needs about {errors.byte_size(needed)}; {last_complete(ckpts, ' once there is room')}")
    try:
        ckpts.save(step, state, position, config_json)
    except Exception as e:  # noqa: BLE001 - Orbax wraps I/O errors in its own types
        raise _save_failed(ckpts, step, e) from e      # the previous save landed in finish(): the error is step's


def poll_saves(ckpts: checkpoint.Checkpoints) -> None:
    try:
        ckpts.poll()
    except Exception as e:  # noqa: BLE001
        raise _save_failed(ckpts, ckpts.pending, e) from e


def close_checkpoints(ckpts: checkpoint.Checkpoints, workdir: str, quiet: bool = False) -> None:
    """Wait for the last asynchronous save and close the manager (idempotent).

    `quiet`: an error is already on its way up (only log a failed save)."""
    try:
        ckpts.close()
    except Exception as e:  # noqa: BLE001
        if not quiet:
            raise _save_failed(ckpts, ckpts.pending, e) from e
        log.error("%s", _save_failed(ckpts, ckpts.pending, e))


def _save_failed(ckpts: checkpoint.Checkpoints, step: int | None, error: Exception) -> errors.RunStopped:
    lost = distributed.lost_process(error)
    if lost is not None:            # another process is gone: closing the manager would wait for it
        return lost_error(ckpts, f"while checkpoint {step} was saved: {lost}")
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:   # Orbax wraps the OSError
        if isinstance(cause, OSError):
            break
        cause = cause.__cause__ or cause.__context__
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)   # the failed writes' orphaned futures, at exit
    try:
        ckpts.close()         # let the background writers stop before their folders are removed
    except Exception:  # noqa: BLE001, S110 - the same failure, reported here
        pass
    removed = ckpts.remove_partial() if jax.process_index() == 0 else []
    return CheckpointSaveError(
        f"saving checkpoint{f' {step}' if step is not None else ''} in {ckpts.directory} failed: "
        f"{errors.describe(cause)}"
        + (f"; removed its unfinished folder(s) {removed}" if removed else "")
        + f"; {last_complete(ckpts, ' once there is room')}")


PROG = "python -m infjax.train"


def define_flags(fv: flags.FlagValues) -> None:
    """Every flag of `python -m infjax.train`, into `fv` (`--config.a.b=value` overrides any config key)."""
    cli.define_config(fv, "Config file, e.g. configs/multi_pi.py[:preset]; --config.KEY=VALUE overrides any key "
                          "of it (every key and its default: infjax/config.py).")
    flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics.jsonl, eval.json "
                                         "(default runs/<objective>).", flag_values=fv)


def parse_flags(argv: list[str]) -> flags.FlagValues:
    """The parsed flags with the config file loaded now: a bad flag, config file, preset or config key is one
    line naming it and exit status 2 (absl alone prints tracebacks for most of them). Under the embedded preset,
    a data.source of one's own trains with the defaults, not the synthetic demo's (`config.for_data_source`)."""
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
