"""Config files, presets, overrides and validation (refused before anything compiles)."""
import glob
import json
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from infjax import config as config_lib, errors
from infjax.losses import OBJECTIVES
from tests.helpers.configs import small_config
from tests.helpers.paths import ROOT


def load_config_file(name, arg=None):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def test_every_objective_has_a_config_file():
    names = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))}
    assert set(OBJECTIVES) <= names
    for name in OBJECTIVES:
        c = load_config_file(name)
        assert c.objective == name
        config_lib.validate(c, num_devices=8)


def test_default_preset_is_embedded_and_hub_presets_point_at_hub_ids():
    c = load_config_file("multi_pi")
    assert c.model.checkpoint == config_lib.EMBEDDED and c.data.source == "synthetic"
    e5 = load_config_file("multi_pi", "e5-base-v2")
    assert e5.model.checkpoint == "intfloat/e5-base-v2" and e5.data.source == "InF-IR/InF-IR"
    assert e5.data.query_prefix == "query: " and e5.data.query_max_len == 256 and e5.data.passage_max_len == 512
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_config_file("multi_pi", "nope")


@pytest.mark.parametrize("key, value, message", [
    ("objective", "multi_px", "config.objective='multi_px'"),
    ("train.steps", -1, "config.train.steps=-1"),
    ("train.batch_size", 3, "config.train.batch_size=3: gives 9 rows"),
    ("train.batch_size", 0, "config.train.batch_size=0"),
    ("loss.temperature", 0.0, "config.loss.temperature=0.0"),
    ("loss.instruction_negatives", 0, "config.loss.instruction_negatives=0"),
    ("model.pooling", "max", "config.model.pooling='max'"),
    ("data.query_template", "{query}", "config.data.query_template"),
    ("data.on_bad_row", "ignore", "config.data.on_bad_row='ignore'"),
    ("data.pack_shapes", 0, "config.data.pack_shapes=0: must be an integer >= 1"),
    ("data.pack_rows_passage", -2, "config.data.pack_rows_passage=-2: must be an integer >= 0"),
    ("data.step_workers", -2, "config.data.step_workers=-2: must be an integer >= -1"),
    ("data.tokenize_workers", -3, "config.data.tokenize_workers=-3: must be an integer >= -1"),
    ("data.prefetch", 0, "config.data.prefetch=0: must be an integer >= 1"),
    ("model.residual_dtype", "bfloat16", "config.model.residual_dtype='bfloat16': must be float32 (as torch.autocast)"),
    ("mesh.fsdp", 0, "config.mesh.fsdp=0"),
    ("mesh.data", 3, "config.mesh.data=3"),
])
def test_invalid_values_are_refused_with_the_key(key, value, message):
    c = load_config_file("multi_pi")
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.validate(c, num_devices=8)
    assert message in str(err.value)


def run_cli(*args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    return subprocess.run([sys.executable, "-m", "infjax.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_refuses_bad_override_before_compiling(tmp_path):
    out = run_cli("--config=configs/multi_pi.py", f"--workdir={tmp_path}", "--config.train.steps=-5")
    assert out.returncode == 2
    assert "config.train.steps=-5" in out.stderr
    assert "eval before" not in out.stderr and not os.listdir(tmp_path)


def test_cli_names_the_missing_data_path(tmp_path):
    missing = str(tmp_path / "nope.parquet")
    out = run_cli("--config=configs/multi_pi.py", f"--workdir={tmp_path / 'w'}", f"--config.data.source={missing}")
    assert out.returncode == 2 and "nope.parquet" in out.stderr


def test_cli_offline_hub_preset_says_how_to_pass_a_local_folder(tmp_path):
    out = run_cli("--config=configs/multi_pi.py:e5-base-v2", f"--workdir={tmp_path}",
                  "--config.data.source=synthetic")
    assert out.returncode == 2
    assert "intfloat/e5-base-v2" in out.stderr and "--config.model.checkpoint" in out.stderr


def test_a_preset_prefix_kept_for_another_model_is_named():
    from infjax import config as config_lib

    c = config_lib.base_config("multi_pi", "e5-base-v2")
    assert config_lib.preset_mismatch(c) is None
    c.model.checkpoint = "BAAI/bge-base-en-v1.5"
    message = config_lib.preset_mismatch(c)
    assert message.startswith("model.checkpoint=BAAI/bge-base-en-v1.5 replaces preset 'e5-base-v2''s "
                              "intfloat/e5-base-v2, but the preset's data.query_prefix='query: ', "
                              "data.passage_prefix='passage: ', model.pooling='mean'")
    c.data.query_prefix = c.data.passage_prefix = ""
    c.model.pooling = "cls"
    assert config_lib.preset_mismatch(c) is None
    assert config_lib.preset_mismatch(config_lib.base_config("multi_pi")) is None       # the embedded default


def test_ones_own_data_trains_the_documented_defaults_and_the_demo_stays_on_the_synthetic_corpus():
    """One's own data (`--config.data.source=FILE`) trains the README's table of defaults (2 epochs of 32
    records, 256/512 tokens); the embedded preset's demo stays on the synthetic corpus (150 steps of 8
    records, 48 tokens); a key given on the command line wins."""
    from infjax import train

    def shape(*argv):
        c = train.parse_flags([f"--config={os.path.join(ROOT, 'configs', 'multi_pi.py')}", *argv]).config
        return (c.data.query_max_len, c.data.passage_max_len, c.train.batch_size, c.train.steps, c.train.epochs,
                c.loss.instruction_negatives, c.checkpoint.every, c.model.checkpoint)

    embedded = config_lib.EMBEDDED
    assert shape() == (48, 48, 8, 150, 2, 3, 50, embedded)                # the quickstart: offline, minutes
    assert shape("--config.data.source=/data/own.parquet") == (256, 512, 32, 0, 2, 5, 500, embedded)
    assert shape("--config.data.source=/data/own.parquet", "--config.train.batch_size=8",
                 "--config.data.passage_max_len=48") == (256, 48, 8, 0, 2, 5, 500, embedded)
    c = config_lib.base_config("multi_pi")
    assert config_lib.describe_shape(c) is None
    c.data.source = "/data/own.parquet"
    config_lib.for_data_source(c)
    assert config_lib.describe_shape(c) == (
        "data.source=/data/own.parquet: preset 'embedded' (embedded:all-MiniLM-L6-v2); queries cut at 256 tokens, "
        "passages at 512, 32 records per batch, 2 epochs (data.query_max_len, data.passage_max_len, "
        "train.batch_size, train.epochs change them)")
    e5 = config_lib.base_config("multi_pi", "e5-base-v2")
    assert config_lib.for_data_source(e5) == []                          # the hub presets have these defaults


@pytest.mark.parametrize("key", ["train.learning_rate", "loss.temperature", "train.weight_decay",
                                 "train.grad_clip"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_float_knobs_are_refused_naming_the_key(key, value):
    with pytest.raises(errors.ConfigError, match=f"config.{key}=.*finite"):
        config_lib.validate(small_config(**{key: value}))


@pytest.mark.parametrize("mesh, key", [({"fsdp": 3}, "mesh.fsdp=3"), ({"data": 3}, "mesh.data=3"),
                                       ({"data": 2, "tensor": 3}, "mesh.tensor=3")])
def test_mesh_error_blames_the_axis_that_does_not_divide(mesh, key):
    with pytest.raises(errors.ConfigError, match=f"config.{key}: mesh"):
        config_lib.validate(small_config(**{f"mesh.{a}": v for a, v in mesh.items()}), num_devices=8)


@pytest.mark.parametrize("value", [-1.0, -0.5])
def test_a_stop_grace_that_is_not_seconds_is_refused_naming_the_key(value):
    with pytest.raises(errors.ConfigError, match=re.escape(f"config.train.stop_grace_s={value!r}: must be >= 0 "
                                                           f"seconds")):
        config_lib.validate(small_config(**{"train.stop_grace_s": value}))


def test_incompatible_changes_allow_harmless_keys():
    a = json.loads(small_config().to_json_best_effort())
    b = json.loads(small_config(**{"train.steps": 99, "log_every": 7, "eval.batch_size": 3, "mesh.data": 2,
                                   "checkpoint.every": 5, "resume": True}).to_json_best_effort())
    assert config_lib.incompatible_changes(a, b) == []
    c = json.loads(small_config(**{"data.query_max_len": 40}).to_json_best_effort())
    assert [k for k, _, _ in config_lib.incompatible_changes(a, c)] == ["data.query_max_len"]


def test_a_checkpoint_from_before_the_loss_recipes_resumes_only_as_it_trained():
    """A saved config without the keys the recipes added trained without them: resuming with masking on is a
    change named by its key; with it off, none."""
    old = json.loads(small_config().to_json_best_effort())
    for key in config_lib.ADDED_KEYS:
        section, name = key.split(".")
        del old[section][name]
    now = json.loads(small_config().to_json_best_effort())
    assert config_lib.incompatible_changes(old, now) == [("loss.mask_duplicates", False, True)]
    off = json.loads(small_config(**{"loss.mask_duplicates": False}).to_json_best_effort())
    assert config_lib.incompatible_changes(old, off) == []
    dims = json.loads(small_config(**{"loss.mask_duplicates": False, "loss.matryoshka_dims": "16"}
                                   ).to_json_best_effort())
    assert config_lib.incompatible_changes(old, dims) == [("loss.matryoshka_dims", "", "16")]


@pytest.mark.parametrize("overrides, key, why", [
    ({"loss.matryoshka_dims": "64,x"}, "loss.matryoshka_dims", "positive whole numbers"),
    ({"loss.matryoshka_dims": "64,32", "loss.matryoshka_weights": "1"}, "loss.matryoshka_weights", "one number"),
    ({"loss.false_negative_margin": 3.0}, "loss.false_negative_margin", "between -2 and 2"),
])
def test_the_loss_recipes_keys_are_refused_naming_the_key(overrides, key, why):
    with pytest.raises(config_lib.ConfigError, match=f"config.{key}=.*{why}"):
        config_lib.validate(small_config(**overrides), 8)


def test_a_matryoshka_dim_wider_than_the_model_is_refused_with_the_width():
    from infjax.training import setup as setup_lib

    config = small_config(**{"loss.matryoshka_dims": "64,16"})
    with pytest.raises(config_lib.ConfigError, match=r"matryoshka_dims='64,16': 64 is wider than the model's "
                                                     r"embeddings \(32\)"):
        setup_lib.make_objective(config, 32)
    objective = setup_lib.make_objective(small_config(**{"loss.matryoshka_dims": "8,32"}), 32)
    assert objective.dims == (32, 8) and objective.dim_weights == (1.0, 1.0) and objective.mask_duplicates
