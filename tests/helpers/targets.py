"""Compile-only accelerators for the tests (tests/accelerators/): the target's devices, or a skip naming the extra
that installs its compiler. Everything that makes this CPU answer as the target would is infjax's own
(`infjax.runtime.targets` describes the devices, `infjax.models.kernels.targeting` answers for them)."""
import importlib.util

import pytest

from infjax.benchmarks import shapes as bench_shapes
from infjax.runtime import targets

PLUGINS = {"cuda": ("jax_cuda13_plugin", "jax_cuda12_plugin"), "tpu": ("libtpu",)}

# Tiny backbones as config.json only (no weights: only compiled), each with what its family's attention needs
# checked: BERT (bidirectional, 4 heads of 16), Qwen2 (causal, 4 query heads on 2 kv heads of 32, remat and
# scanned layers in the presets' way), ModernBERT (a global layer and two local ones with a two-sided window).
TINY = {
    "bert": (dict(bench_shapes.BERT_BASE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128), {}),
    "qwen2": (dict(bench_shapes.QWEN25_15B, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=256, vocab_size=30522, max_position_embeddings=512),
              {"model.pooling": "last", "model.remat": "full", "model.scan_layers": True}),
    "modernbert": (dict(model_type="modernbert", architectures=["ModernBertModel"], vocab_size=30522,
                        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        global_attn_every_n_layers=3, local_attention=32, max_position_embeddings=512,
                        pad_token_id=0), {}),
}


def compile_only_devices(name: str):
    """The compile-only devices of target `name` (infjax.runtime.targets), or skip naming the extra to install."""
    target = targets.parse(name)
    if not any(importlib.util.find_spec(p) for p in PLUGINS[target.family]):
        pytest.skip(f"no {target.family} compiler: pip install -e \".[{target.extra}]\" (compile-only, no device)")
    return target, targets.devices(target)


def tiny_folder(family: str, root) -> str:
    """A checkpoint folder of family's tiny config.json and a tokenizer (no weights)."""
    hf_config, _ = TINY[family]
    return bench_shapes.checkpoint_folder(hf_config, str(root))


def tiny_overrides(family: str, root) -> dict:
    return {"model.checkpoint": tiny_folder(family, root), "model.family": "auto", **TINY[family][1]}
