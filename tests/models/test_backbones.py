"""ModernBERT, Llama and Qwen2 backbones: exact HF import, export round trip, padding, remat/scan, bf16."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax.models import layers as L
from infjax.models.decoder import DecoderConfig
from infjax.models.encoder import Encoder, detect_family, load_encoder
from infjax.models import registry
from infjax.models.hf.files import load_hf_config, read_safetensors
from infjax.models.modernbert import ModernBertConfig
from tests.helpers.backbones import FAMILIES, VOCAB, tiny_checkpoint

DECODERS = ("llama", "qwen2")
LOADERS = {f: registry.FAMILIES[f].load for f in FAMILIES}
TO_HF = {f: registry.FAMILIES[f].names.to_hf for f in FAMILIES}
CONFIGS = {"modernbert": ModernBertConfig, "llama": DecoderConfig, "qwen2": DecoderConfig}
SEQ = 16
LENGTHS = (16, 9, 3)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def checkpoint(family, tmp_path_factory):
    return tiny_checkpoint(family, tmp_path_factory)


def _batch(family, seed=0):
    """Random ids [3, 16] padded on the family's side (left for decoders) with lengths 16, 9, 3."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=(len(LENGTHS), SEQ))
    pos = np.arange(SEQ)[None]
    lengths = np.array(LENGTHS)[:, None]
    mask = (pos >= SEQ - lengths) if family in DECODERS else (pos < lengths)
    return np.where(mask, ids, 0).astype(np.int32), mask.astype(np.int32)


def _torch_hidden(model, family, ids, mask):
    """Last hidden states of the torch model; decoders get the position ids infjax derives from the mask."""
    import torch

    kwargs = {"input_ids": torch.as_tensor(ids, dtype=torch.long), "attention_mask": torch.as_tensor(mask)}
    if family in DECODERS:
        kwargs["position_ids"] = torch.as_tensor(np.maximum(np.cumsum(mask, 1) - 1, 0), dtype=torch.long)
    with torch.no_grad():
        return model(**kwargs).last_hidden_state.float().numpy()


def _max_diff(a, b, mask):
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))[mask.astype(bool)].max())


def _apply(module, params, ids, mask):
    return np.asarray(jax.jit(lambda p, i, m: module.apply({"params": p}, i, m))(params, ids, mask))


def test_import_matches_pytorch(family, checkpoint):
    folder, model = checkpoint
    module, params, hf_config, path = LOADERS[family](folder)
    assert path == folder and hf_config["model_type"] == family
    ids, mask = _batch(family)
    ours = _apply(module, params, ids, mask)
    ref = _torch_hidden(model, family, ids, mask)
    diff = _max_diff(ours, ref, mask)
    print(f"{family} import: max abs diff {diff:.2e} (max |h| {np.abs(ref).max():.2f})")
    assert diff <= 1e-5


def test_export_round_trip_matches_pytorch(family, checkpoint, tmp_path):
    import transformers

    from infjax.models.hf.files import save_safetensors

    folder, model = checkpoint
    module, params, hf_config, _ = LOADERS[family](folder)
    config = CONFIGS[family].from_hf_dict(hf_config)
    tensors = TO_HF[family](params, config)
    # a lossless name map: the very tensors transformers saved
    original = {k: v.numpy() for k, v in model.state_dict().items()}
    assert sorted(tensors) == sorted(original)
    assert all(np.array_equal(tensors[k], original[k]) for k in tensors)
    save_safetensors(str(tmp_path), tensors, 10**9)      # the writer of export (kernels are transposed views)
    shutil.copy(os.path.join(folder, "config.json"), tmp_path / "config.json")
    reloaded = transformers.AutoModel.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids, mask = _batch(family, seed=1)
    diff = _max_diff(_apply(module, params, ids, mask), _torch_hidden(reloaded, family, ids, mask), mask)
    print(f"{family} export round trip: max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_rope_frequencies_match_transformers(family, checkpoint):
    """The llama3 schedule and ModernBERT's two thetas give HF's inverse frequencies."""
    folder, model = checkpoint
    hf_config = load_hf_config(folder)
    rotary = model.rotary_emb
    if family == "modernbert":
        config = ModernBertConfig.from_hf_dict(hf_config)
        for kind, theta in (("full_attention", config.global_rope_theta),
                            ("sliding_attention", config.local_rope_theta)):
            ours = L.rope_inv_freq(config.head_dim, L.RopeConfig(theta))
            np.testing.assert_allclose(ours, getattr(rotary, f"{kind}_inv_freq").numpy(), rtol=1e-6)
        assert config.global_rope_theta != config.local_rope_theta
        assert config.layer_types == ("full_attention", "sliding_attention", "full_attention")
    else:
        config = DecoderConfig.from_hf_dict(hf_config)
        np.testing.assert_allclose(L.rope_inv_freq(config.head_dim, config.rope), rotary.inv_freq.numpy(), rtol=1e-6)
        if family == "llama":
            assert config.rope.rope_type == "llama3"
            plain = L.rope_inv_freq(config.head_dim, L.RopeConfig(config.rope.theta))
            ours = L.rope_inv_freq(config.head_dim, config.rope)
            assert ours[0] == plain[0] and ours[-1] == plain[-1] / 8 and plain[1] / 8 < ours[1] < plain[1]


@pytest.mark.parametrize("family", DECODERS)
def test_left_padded_last_token_equals_unpadded(family, tmp_path_factory):
    folder, _ = tiny_checkpoint(family, tmp_path_factory)
    module, params, _, _ = LOADERS[family](folder)
    encoder = jax.jit(Encoder(module, "last", "left"))
    ids, mask = _batch(family)
    padded = np.asarray(encoder(params, ids, mask))
    for row, n in enumerate(LENGTHS):
        alone = ids[row:row + 1, SEQ - n:]
        single = np.asarray(encoder(params, alone, np.ones_like(alone)))
        np.testing.assert_allclose(padded[row], single[0], atol=2e-6)


def _rewrite_tensors(folder, dest, drop=(), add=None):
    from safetensors.numpy import save_file

    tensors = {k: v for k, v in read_safetensors(folder).items() if k not in drop}
    tensors.update(add or {})
    os.makedirs(dest, exist_ok=True)
    save_file(tensors, os.path.join(dest, "model.safetensors"))
    shutil.copy(os.path.join(folder, "config.json"), os.path.join(dest, "config.json"))
    return dest


def test_missing_and_unexpected_tensors_are_named(family, checkpoint, tmp_path):
    folder, _ = checkpoint
    drop = "layers.1.mlp.Wo.weight" if family == "modernbert" else "layers.1.mlp.up_proj.weight"
    bad = _rewrite_tensors(folder, str(tmp_path / "bad"), drop=[drop],
                           add={"layers.0.surprise.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError) as e:
        LOADERS[family](bad)
    assert drop in str(e.value) and "missing" in str(e.value)
    assert "layers.0.surprise.weight" in str(e.value) and "unexpected" in str(e.value)
    # the LM / MLM heads of *For* checkpoints are not part of the encoder and are ignored
    head = "decoder.bias" if family == "modernbert" else "lm_head.weight"
    prefixed = {("model." + k): v for k, v in read_safetensors(folder).items()}
    ok = _rewrite_tensors(folder, str(tmp_path / "ok"), drop=list(read_safetensors(folder)),
                          add={**prefixed, head: np.zeros((VOCAB,), np.float32)})
    LOADERS[family](ok)


def test_unknown_or_mismatched_model_type_is_refused(tmp_path, tmp_path_factory):
    folder, _ = tiny_checkpoint("qwen2", tmp_path_factory)
    with pytest.raises(ValueError, match="'qwen2', expected 'llama'"):
        LOADERS["llama"](folder)
    with pytest.raises(ValueError, match="model_type"):
        LOADERS["modernbert"](folder)
    odd = tmp_path / "odd"
    odd.mkdir()
    config = load_hf_config(folder)
    config["model_type"] = "gpt_neox"
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'gpt_neox' is not supported"):
        detect_family(str(odd))
    with pytest.raises(ValueError, match="gpt_neox"):
        LOADERS["qwen2"](str(odd))


def test_hub_style_configs_parse():
    """config.json as published on the hub (older key names) gives the intended architecture."""
    llama = DecoderConfig.from_hf_dict({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}})
    assert llama.rope == L.RopeConfig(500000.0, "llama3", 32.0, 1.0, 4.0, 8192) and not llama.qkv_bias
    qwen = DecoderConfig.from_hf_dict({
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "rope_theta": 1000000.0,
        "rope_scaling": None, "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 21})
    assert qwen.qkv_bias and qwen.head_dim == 128 and qwen.rope == L.RopeConfig(1000000.0)
    modern = ModernBertConfig.from_hf_dict({
        "model_type": "modernbert", "vocab_size": 50368, "hidden_size": 768, "intermediate_size": 1152,
        "num_hidden_layers": 22, "num_attention_heads": 12, "global_attn_every_n_layers": 3,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "local_attention": 128})
    assert modern.window == 64 and modern.layer_types[:4] == ("full_attention",) + ("sliding_attention",) * 2 + (
        "full_attention",) and modern.layer_types[-1] == "full_attention"
    with pytest.raises(ValueError, match="use_sliding_window"):
        DecoderConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                    "num_hidden_layers": 1, "num_attention_heads": 2, "use_sliding_window": True})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        DecoderConfig.from_hf_dict({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                    "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_remat_and_scan_give_the_same_outputs_and_gradients(family, checkpoint):
    folder, _ = checkpoint
    module, params, _, _ = LOADERS[family](folder)
    ids, mask = _batch(family)
    reference = _apply(module, params, ids, mask)
    first = 1 if family == "modernbert" else 0

    def loss(m):
        return lambda p: jnp.sum(jnp.tanh(m.apply({"params": p}, ids, mask)) * mask[..., None])

    ref_grads = jax.jit(jax.grad(loss(module)))(params)
    for remat, scan in ((False, True), (True, True)):       # remat alone changes only the backward pass
        m, p, _, _ = LOADERS[family](folder, remat=remat, scan_layers=scan)
        assert (m.remat, m.scan_layers) == (remat, scan)
        assert (L.SCANNED in p) == scan
        np.testing.assert_allclose(_apply(m, p, ids, mask), reference, atol=1e-5, err_msg=f"remat={remat} scan={scan}")
        if remat and scan:
            grads = L.unstack_layers(jax.jit(jax.grad(loss(m)))(p), first)
            scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads))
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6 * scale), grads, ref_grads)
            # the scanned tree exports to the same HF tensors
            config = CONFIGS[family].from_hf_dict(load_hf_config(folder))
            exported, plain = TO_HF[family](p, config), TO_HF[family](params, config)
            assert all(np.array_equal(exported[k], plain[k]) for k in plain)


def test_bfloat16_compute_runs(family, checkpoint):
    folder, _ = checkpoint
    module32, params, _, _ = LOADERS[family](folder)
    module16, params16, _, _ = LOADERS[family](folder, dtype=jnp.bfloat16)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(params16))     # params stay float32
    ids, mask = _batch(family)
    out = module16.apply({"params": params16}, ids, mask)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))      # the residual stream's dtype
    all16, _, _, _ = LOADERS[family](folder, dtype=jnp.bfloat16, residual="compute")
    assert all16.apply({"params": params16}, ids, mask).dtype == jnp.bfloat16
    pooling = "last" if family in DECODERS else "mean"
    side = "left" if family in DECODERS else "right"
    e32 = np.asarray(Encoder(module32, pooling, side)(params, ids, mask))
    e16 = np.asarray(Encoder(module16, pooling, side)(params16, ids, mask))
    assert e16.dtype == np.float32 and (e32 * e16).sum(1).min() > 0.99


def test_load_encoder_picks_family_padding_side_and_options(family, checkpoint):
    from ml_collections import ConfigDict

    folder, _ = checkpoint
    config = ConfigDict({"checkpoint": folder, "family": "auto", "pooling": "mean", "shared_encoder": True,
                         "dtype": "float32", "remat": True, "scan_layers": True})
    encoder, params, path = load_encoder(config)
    assert encoder.padding_side == ("left" if family in DECODERS else "right")
    assert encoder.module.remat and encoder.module.scan_layers and L.SCANNED in params["shared"]
    config.family = "bert"
    with pytest.raises(ValueError, match="model.family='bert'"):
        load_encoder(config)


def test_family_default_pooling_for_runs_and_evaluation(family, checkpoint):
    """model.pooling=auto (the default; also what `infjax.evaluate` passes for an HF folder without
    --pooling or a sentence-transformers pooling file) is the family's own: last token for decoders, mean
    for ModernBERT (and BERT)."""
    from ml_collections import ConfigDict

    folder, _ = checkpoint
    expected = "last" if family in DECODERS else "mean"
    config = ConfigDict({"checkpoint": folder, "family": "auto", "pooling": "auto", "shared_encoder": True,
                         "dtype": "float32"})
    assert load_encoder(config)[0].pooling == expected
