"""Test setup: 8 fake CPU devices, set before JAX is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.helpers.configs import small_config  # noqa: E402  (imports JAX: after the environment above)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's compiled programs and what they hold: a test process otherwise keeps
    every program of the suite (several GB by the end), which two test processes side by side cannot afford."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests that take minutes (deselect with -m 'not slow')")


@pytest.fixture(scope="session")
def four_step_run(tmp_path_factory):
    """One small run shared by the fault-tolerance and hardening tests (copy it before changing it).

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

