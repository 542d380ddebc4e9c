"""BERT encoder, pooling and Hugging Face checkpoint I/O."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax import config as config_lib, export
from infjax.models.hf import files as hf_files
from infjax.models.registry import FAMILIES
from infjax.models import layers as L
from infjax.models.bert import BertConfig, BertModel
from infjax.models.encoder import load_encoder
from infjax.models.pooling import l2_normalize, pool
from infjax.runtime import partitioning

TEXTS = [
    "Find documents about cats.",
    "Instruction: retrieve passages that answer the question, ignoring anything about dogs or other pets.",
    "hi",
    "What is the capital of France?",
]

TINY_HF_KWARGS = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    type_vocab_size=2,
)


def _torch_last_hidden(model, batch):
    """Last hidden state of a torch BertModel on a numpy batch (fp32, eval mode)."""
    import torch

    with torch.no_grad():
        out = model(**{k: torch.as_tensor(v) for k, v in batch.items()})
    return out.last_hidden_state.float().numpy()


def _masked_max_diff(a, b, mask):
    """Max |a - b| over the positions where mask == 1."""
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))[mask.astype(bool)].max())


def _padded_random_batch(seed=0, batch=3, seq_len=11, vocab=99):
    """Random ids with right padding of different lengths and random token types."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(batch, seq_len)).astype(np.int64)
    lengths = np.array([seq_len, 6, 2][:batch])
    mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int64)
    ids = ids * mask
    types = (rng.random((batch, seq_len)) > 0.5).astype(np.int64) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


@pytest.fixture(scope="module")
def minilm_path():
    try:
        return hf_files.embedded_minilm_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny transformers BertModel saved as safetensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(**TINY_HF_KWARGS)).eval()
    with torch.no_grad():  # make LayerNorm / biases non-trivial so the name map matters
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(folder)
    return str(folder), model


# --------------------------------------------------------------------------
# Real MiniLM weights
# --------------------------------------------------------------------------


def test_minilm_matches_transformers_and_sentence_transformers(minilm_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    st = pytest.importorskip("sentence_transformers")

    module, params, hf_config, path = FAMILIES["bert"].load(minilm_path)
    assert path == minilm_path and hf_config["model_type"] == "bert"
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    batch = dict(tokenizer(TEXTS, padding=True, return_tensors="np"))
    assert len(set(batch["attention_mask"].sum(1).tolist())) == len(TEXTS)  # all lengths differ

    hidden = module.apply(
        {"params": params}, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    )
    assert hidden.dtype == jnp.float32 and hidden.shape == (*batch["input_ids"].shape, 384)
    reference = _torch_last_hidden(transformers.BertModel.from_pretrained(path).eval(), batch)
    diff = _masked_max_diff(hidden, reference, batch["attention_mask"])
    print(f"MiniLM max abs diff vs transformers: {diff:.3e}")
    assert diff <= 1e-4

    ours = np.asarray(l2_normalize(pool(hidden, batch["attention_mask"], "mean")))
    theirs = st.SentenceTransformer(path, device="cpu").encode(TEXTS)
    theirs = theirs / np.linalg.norm(theirs, axis=1, keepdims=True)
    cosine = np.sum(ours * theirs, axis=1)
    print(f"MiniLM min cosine vs sentence-transformers: {cosine.min():.7f}")
    assert np.all(cosine >= 0.9999)


def _minilm_batch(path):
    """The TEXTS tokenized by the checkpoint's tokenizer, right-padded (numpy)."""
    transformers = pytest.importorskip("transformers")
    return dict(transformers.AutoTokenizer.from_pretrained(path)(TEXTS, padding=True, return_tensors="np"))


def _hidden(module, params, batch):
    """Last hidden states of ``module`` on a tokenized batch (eval mode, jitted as training and inference run it;
    op-by-op eager execution rounds differently at the ~1e-5 level on padded positions)."""
    fn = jax.jit(lambda p: module.apply({"params": p}, batch["input_ids"], batch["attention_mask"],
                                        batch["token_type_ids"]))
    return np.asarray(fn(params))


def test_minilm_scan_layers_matches_unrolled(minilm_path):
    """Real weights: the scanned stack (loaded stacked under ``layers``) gives the unrolled hidden states."""
    batch = _minilm_batch(minilm_path)
    module, params, _, _ = FAMILIES["bert"].load(minilm_path)
    scanned, stacked, _, _ = FAMILIES["bert"].load(minilm_path, scan_layers=True)
    assert scanned.scan_layers and not module.scan_layers
    assert set(stacked) == {"embeddings", L.SCANNED}
    assert stacked[L.SCANNED]["attention"]["query"]["kernel"].shape == (6, 384, 384)
    jax.tree.map(np.testing.assert_array_equal, L.unstack_layers(stacked, 0), params)
    diff = float(np.abs(_hidden(scanned, stacked, batch) - _hidden(module, params, batch)).max())
    print(f"MiniLM scan vs unrolled max abs diff: {diff:.3e}")
    assert diff <= 1e-5


def test_minilm_scan_via_config_encoder_and_partition_rules(minilm_path):
    """``model.scan_layers=True`` passes validation for BERT, loads stacked, and every stacked
    parameter gets its per-layer spec with an unsharded leading layer axis."""
    from jax.sharding import Mesh, PartitionSpec as P
    from ml_collections import ConfigDict

    config = config_lib.override(config_lib.base_config("multi_pi"),
                                 {"model.family": "bert", "model.scan_layers": True, "model.remat": "full"})
    config_lib.validate(config, 8)
    encoder, params, _ = load_encoder(ConfigDict({"checkpoint": minilm_path, "family": "bert", "pooling": "mean",
                                                  "shared_encoder": True, "dtype": "float32", "remat": True,
                                                  "scan_layers": True}))
    assert encoder.module.scan_layers and encoder.module.remat and L.SCANNED in params["shared"]
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4, 1), ("data", "fsdp", "tensor"))
    specs = partitioning.param_specs(params, encoder.module, mesh)["shared"]
    layer = specs[L.SCANNED]
    assert layer["attention"]["query"]["kernel"] == P(None, "fsdp", None)
    assert layer["attention"]["output"]["kernel"] == P(None, None, "fsdp")
    assert layer["intermediate"]["kernel"] == P(None, "fsdp", None)
    assert layer["output"]["kernel"] == P(None, None, "fsdp")
    assert layer["attention"]["query"]["bias"] == P(None, None)
    assert layer["output_LayerNorm"]["scale"] == P(None, None)


def test_scanned_minilm_exports_and_transformers_reproduces_it(minilm_path, tmp_path):
    """A scanned (stacked) BERT tree exports to HF names; transformers loads it and gives our states."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    module, params, hf_config, _ = FAMILIES["bert"].load(minilm_path, scan_layers=True)
    rng = np.random.default_rng(0)     # move away from the base weights, as training would
    params = jax.tree.map(lambda x: x + 0.01 * rng.standard_normal(x.shape).astype(x.dtype), params)
    config = BertConfig.from_hf_dict(hf_config)
    tensors = FAMILIES["bert"].names.to_hf(params, config)
    unrolled = FAMILIES["bert"].names.to_hf(L.unstack_layers(params, 0), config)
    assert set(tensors) == set(unrolled)
    assert all(np.array_equal(tensors[k], unrolled[k]) for k in unrolled)

    out = str(tmp_path / "export")
    export.export_model(out, family="bert", params={"shared": params}, hf_config=hf_config, base_path=minilm_path,
                        pooling="mean", padding_side="right")
    batch = _minilm_batch(minilm_path)
    reference = _torch_last_hidden(transformers.BertModel.from_pretrained(out).eval(), batch)
    diff = _masked_max_diff(_hidden(module, params, batch), reference, batch["attention_mask"])
    print(f"scanned export max abs diff vs transformers: {diff:.3e}")
    assert diff <= 1e-4
    base = _torch_last_hidden(transformers.BertModel.from_pretrained(minilm_path).eval(), batch)
    assert _masked_max_diff(base, reference, batch["attention_mask"]) > 1e-3   # the new weights were exported


# --------------------------------------------------------------------------
# Tiny random checkpoint
# --------------------------------------------------------------------------


def test_tiny_checkpoint_matches_torch(tiny_checkpoint):
    folder, torch_model = tiny_checkpoint
    module, params, _, _ = FAMILIES["bert"].load(folder)
    batch = _padded_random_batch()
    hidden = module.apply(
        {"params": params}, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    )
    reference = _torch_last_hidden(torch_model, batch)
    diff = _masked_max_diff(hidden, reference, batch["attention_mask"])
    print(f"tiny fp32 max abs diff vs transformers: {diff:.3e}")
    assert diff <= 1e-5

    # bf16 computes; the residual stream (and so the output) in float32 by default, in bf16 under "compute"
    scale = float(np.abs(reference).max())
    for residual, dtype in (("float32", jnp.float32), ("compute", jnp.bfloat16)):
        hidden_bf16 = module.clone(dtype=jnp.bfloat16, residual=residual).apply(
            {"params": params}, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
        )
        assert hidden_bf16.dtype == dtype
        diff_bf16 = _masked_max_diff(hidden_bf16, reference, batch["attention_mask"])
        print(f"tiny bf16 (residual {residual}) max abs diff vs transformers: {diff_bf16:.3e} (max |h| = {scale:.2f})")
        assert diff_bf16 <= 5e-2


@pytest.mark.parametrize("hidden_act", ["gelu_new", "gelu_pytorch_tanh", "swish"])
def test_tanh_gelu_variants_and_swish_match_torch(tmp_path, hidden_act):
    """The non-default activations of the shared table (tanh GELUs, swish = silu) compute HF's ACT2FN."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    config = transformers.BertConfig(**TINY_HF_KWARGS, hidden_act=hidden_act)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(tmp_path)
    module, params, _, _ = FAMILIES["bert"].load(str(tmp_path))
    batch = _padded_random_batch(seed=2)
    hidden = module.apply({"params": params}, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert _masked_max_diff(hidden, _torch_last_hidden(model, batch), batch["attention_mask"]) <= 1e-5


def test_padding_does_not_change_real_positions(tiny_checkpoint):
    module, params, _, _ = FAMILIES["bert"].load(tiny_checkpoint[0])
    ids = np.array([[5, 6, 7, 8]])
    short = module.apply({"params": params}, ids, np.ones_like(ids))
    padded_ids = np.array([[5, 6, 7, 8, 0, 0, 0]])
    padded_mask = np.array([[1, 1, 1, 1, 0, 0, 0]])
    padded = module.apply({"params": params}, padded_ids, padded_mask)
    np.testing.assert_allclose(np.asarray(padded[:, :4]), np.asarray(short), atol=1e-5)


def test_dropout_and_remat(tiny_checkpoint):
    module, params, _, _ = FAMILIES["bert"].load(tiny_checkpoint[0])
    batch = _padded_random_batch()
    args = (batch["input_ids"], batch["attention_mask"])
    eval_out = module.apply({"params": params}, *args)
    rngs = {"dropout": jax.random.PRNGKey(0)}
    train_a = module.apply({"params": params}, *args, deterministic=False, rngs=rngs)
    train_b = module.clone(remat=True).apply({"params": params}, *args, deterministic=False, rngs=rngs)
    assert not np.allclose(np.asarray(train_a), np.asarray(eval_out))
    np.testing.assert_allclose(np.asarray(train_a), np.asarray(train_b), atol=1e-6)


def test_scan_and_remat_give_the_same_outputs_and_gradients(tiny_checkpoint):
    """Small random BERT: scanned (with and without remat) equals unrolled in outputs and gradients."""
    folder, _ = tiny_checkpoint
    module, params, _, _ = FAMILIES["bert"].load(folder)
    batch = _padded_random_batch()
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]

    def loss(m):
        return lambda p: jnp.sum(jnp.tanh(m.apply({"params": p}, ids, mask, types)) * mask[..., None])

    reference = np.asarray(module.apply({"params": params}, ids, mask, types))
    ref_grads = jax.jit(jax.grad(loss(module)))(params)
    for remat in (False, True):
        m, p, _, _ = FAMILIES["bert"].load(folder, remat=remat, scan_layers=True)
        assert (m.remat, m.scan_layers, L.SCANNED in p) == (remat, True, True)
        out = np.asarray(m.apply({"params": p}, ids, mask, types))
        diff = float(np.abs(out - reference).max())
        grads = L.unstack_layers(jax.jit(jax.grad(loss(m)))(p), 0)
        assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref_grads)
        gdiff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), grads, ref_grads)))
        print(f"tiny scan (remat={remat}) max abs diff: hidden {diff:.3e}, gradients {gdiff:.3e}")
        assert diff <= 1e-5
        # fp32 with BERT's one-pass LayerNorm variance: absolute error relative to the largest gradient
        scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), grads, ref_grads)


def test_scan_with_remat_and_dropout(tiny_checkpoint):
    """Dropout runs inside the scan (one mask per layer); remat recomputes the same masks."""
    folder, _ = tiny_checkpoint
    module, params, _, _ = FAMILIES["bert"].load(folder, scan_layers=True)
    batch = _padded_random_batch()
    args = (batch["input_ids"], batch["attention_mask"])
    rngs = {"dropout": jax.random.PRNGKey(0)}
    eval_out = module.apply({"params": params}, *args)
    train_a = module.apply({"params": params}, *args, deterministic=False, rngs=rngs)
    train_b = module.clone(remat=True).apply({"params": params}, *args, deterministic=False, rngs=rngs)
    assert not np.allclose(np.asarray(train_a), np.asarray(eval_out))
    np.testing.assert_allclose(np.asarray(train_a), np.asarray(train_b), atol=1e-6)

    def loss(m):
        return lambda p: jnp.sum(jnp.tanh(m.apply({"params": p}, *args, deterministic=False, rngs=rngs)))

    grads_a = jax.jit(jax.grad(loss(module)))(params)
    grads_b = jax.jit(jax.grad(loss(module.clone(remat=True))))(params)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_b))   # absolute error vs the largest
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale), grads_a, grads_b)


def test_scanned_init_tree_is_the_stacked_name_map_tree(tiny_checkpoint):
    """``init`` of a scanned module gives the layout ``stack_layers`` makes from the HF name map."""
    folder, _ = tiny_checkpoint
    config = BertConfig.from_hf_dict(hf_files.load_hf_config(folder))
    ids = jnp.zeros((1, 3), jnp.int32)
    init_params = BertModel(config, scan_layers=True).init(jax.random.PRNGKey(0), ids, ids)["params"]
    stacked = L.stack_layers(FAMILIES["bert"].names.from_hf(hf_files.read_safetensors(folder), config), 0,
                             config.num_hidden_layers)
    assert jax.tree.map(np.shape, init_params) == jax.tree.map(np.shape, stacked)


def test_init_tree_matches_name_map(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    config = BertConfig.from_hf_dict(hf_files.load_hf_config(folder))
    ids = jnp.zeros((1, 3), jnp.int32)
    init_params = BertModel(config).init(jax.random.PRNGKey(0), ids, ids)["params"]
    loaded = FAMILIES["bert"].names.from_hf(hf_files.read_safetensors(folder), config)
    assert jax.tree_util.tree_structure(init_params) == jax.tree_util.tree_structure(loaded)
    shapes = jax.tree_util.tree_map(lambda x: x.shape, init_params)
    assert shapes == jax.tree_util.tree_map(lambda x: x.shape, loaded)


# --------------------------------------------------------------------------
# Name map and file handling
# --------------------------------------------------------------------------


def test_name_map_round_trip_is_exact(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    config = BertConfig.from_hf_dict(hf_files.load_hf_config(folder))
    tensors = hf_files.read_safetensors(folder)
    back = FAMILIES["bert"].names.to_hf(FAMILIES["bert"].names.from_hf(tensors, config), config)
    kept = {k for k in tensors if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    assert set(back) == kept
    for name in kept:
        assert back[name].dtype == tensors[name].dtype
        np.testing.assert_array_equal(back[name], tensors[name], err_msg=name)


def test_bert_prefix_is_accepted(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    config = BertConfig.from_hf_dict(hf_files.load_hf_config(folder))
    tensors = hf_files.read_safetensors(folder)
    prefixed = {"bert." + k: v for k, v in tensors.items()}
    prefixed["cls.predictions.bias"] = np.zeros(config.vocab_size, np.float32)
    a = FAMILIES["bert"].names.from_hf(tensors, config)
    b = FAMILIES["bert"].names.from_hf(prefixed, config)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    out = FAMILIES["bert"].names.to_hf(b, config, prefix="bert.")
    np.testing.assert_array_equal(out["bert.encoder.layer.1.output.dense.weight"],
                                  tensors["encoder.layer.1.output.dense.weight"])


def test_missing_unexpected_and_misshapen_tensors_are_named(tiny_checkpoint):
    folder, _ = tiny_checkpoint
    config = BertConfig.from_hf_dict(hf_files.load_hf_config(folder))
    tensors = hf_files.read_safetensors(folder)

    missing = dict(tensors)
    del missing["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match=r"missing.*encoder\.layer\.1\.output\.dense\.bias"):
        FAMILIES["bert"].names.from_hf(missing, config)

    extra = dict(tensors, **{"encoder.layer.0.attention.self.rotary.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected.*encoder\.layer\.0\.attention\.self\.rotary\.weight"):
        FAMILIES["bert"].names.from_hf(extra, config)

    wrong = dict(tensors, **{"encoder.layer.0.intermediate.dense.weight": np.zeros((37, 31), np.float32)})
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.intermediate\.dense\.weight"):
        FAMILIES["bert"].names.from_hf(wrong, config)


def test_fp16_bf16_and_sharded_checkpoints_load_as_float32(tiny_checkpoint, tmp_path):
    torch = pytest.importorskip("torch")
    import copy

    folder, shared_model = tiny_checkpoint
    reference = hf_files.read_safetensors(folder)
    for dtype in (torch.float16, torch.bfloat16):
        out = tmp_path / str(dtype).split(".")[-1]
        model = copy.deepcopy(shared_model).to(dtype)
        model.save_pretrained(out, max_shard_size="20KB")
        assert os.path.isfile(out / hf_files.SAFETENSORS_INDEX)
        loaded = hf_files.read_safetensors(str(out))
        assert set(loaded) == set(reference)
        name = "encoder.layer.0.attention.self.query.weight"
        assert loaded[name].dtype == np.float32
        expected = model.state_dict()[name].float().numpy()
        np.testing.assert_array_equal(loaded[name], expected)
        shard = sorted(p for p in os.listdir(out) if p.endswith(".safetensors"))[0]
        raw = hf_files._read_safetensors_raw(str(out / shard))  # the no-ml_dtypes-in-safetensors fallback
        for k, v in raw.items():
            np.testing.assert_array_equal(hf_files._to_float32(v), loaded[k])


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        hf_files.read_safetensors(str(tmp_path))


def test_resolve_checkpoint_offline_names_the_id(monkeypatch, tmp_path):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hf_files.CheckpointNotFound, match="some-org/does-not-exist") as info:
        hf_files.resolve_checkpoint("some-org/does-not-exist")
    assert isinstance(info.value, FileNotFoundError)
    assert "--config.model.checkpoint" in str(info.value)
    assert hf_files.resolve_checkpoint(str(tmp_path)) == str(tmp_path)
    with pytest.raises(hf_files.CheckpointNotFound, match="does not exist"):
        hf_files.resolve_checkpoint(str(tmp_path / "nope"))


def test_config_validation(tmp_path):
    base = {k: v for k, v in TINY_HF_KWARGS.items()}
    assert BertConfig.from_hf_dict(base).hidden_size == 32
    with pytest.raises(ValueError, match=r"my/config\.json.*model_type='roberta'"):
        BertConfig.from_hf_dict(dict(base, model_type="roberta"), source="my/config.json")
    with pytest.raises(ValueError, match="num_attention_heads"):
        BertConfig.from_hf_dict({k: v for k, v in base.items() if k != "num_attention_heads"})
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig.from_hf_dict(dict(base, hidden_act="mish"))
    with pytest.raises(ValueError, match="position_embedding_type"):
        BertConfig.from_hf_dict(dict(base, position_embedding_type="relative_key"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        hf_files.load_hf_config(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_files.load_hf_config(str(tmp_path / "missing"))


# --------------------------------------------------------------------------
# Pooling
# --------------------------------------------------------------------------


def test_last_pooling_left_and_right_padding():
    rng = np.random.default_rng(0)
    seq = rng.normal(size=(5, 8)).astype(np.float32)  # 5 real tokens, H=8
    left = np.concatenate([np.zeros((3, 8), np.float32), seq])[None]
    right = np.concatenate([seq, np.full((3, 8), 7.0, np.float32)])[None]
    left_mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    right_mask = left_mask[:, ::-1]
    unpadded = pool(seq[None], np.ones((1, 5)), "last")
    np.testing.assert_array_equal(np.asarray(unpadded), seq[None, -1])
    np.testing.assert_array_equal(np.asarray(pool(left, left_mask, "last")), seq[None, -1])
    np.testing.assert_array_equal(np.asarray(pool(right, right_mask, "last")), seq[None, -1])


def test_mean_and_cls_pooling_match_numpy():
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(3, 6, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0]])
    expected = np.stack([hidden[b][mask[b] == 1].mean(0) for b in range(3)])
    np.testing.assert_allclose(np.asarray(pool(hidden, mask, "mean")), expected, rtol=1e-6, atol=1e-6)
    first_real = hidden[np.arange(3), mask.argmax(1)]             # position 0, unless left-padded (row 2)
    np.testing.assert_array_equal(np.asarray(pool(hidden, mask, "cls")), first_real)
    out = pool(jnp.asarray(hidden, jnp.bfloat16), mask, "mean")
    assert out.dtype == jnp.float32


def test_unknown_pooling_kind_and_l2_normalize():
    with pytest.raises(ValueError, match="mean.*cls.*last"):
        pool(np.zeros((1, 2, 3)), np.ones((1, 2)), "max")
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    np.testing.assert_allclose(np.asarray(l2_normalize(x)), [[0.6, 0.8], [0.0, 0.0]])
