"""A tiny random BERT for the tests that prove mechanics, not learning.

Two layers of width 32 (2 heads of 16) with all-MiniLM-L6-v2's tokenizer and vocabulary, made from numpy (no
torch, so the Python 3.12 leg can build it) and written as a Hugging Face folder through infjax's own name
map. Every test that compares two runs of the same model (exact resume, SIGTERM, restores onto other meshes,
several processes against one, packed against padded, ...) proves the same with it as with MiniLM, in a
fraction of the compile and step time. Tests that claim learning or parity with real weights keep MiniLM.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

HIDDEN, LAYERS, HEADS, INTERMEDIATE = 32, 2, 2, 64      # heads of 16: the CPU kernel takes them, as MiniLM's 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")


def hf_config() -> dict:
    """config.json of the tiny BERT: MiniLM's, narrowed."""
    return {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": 30522, "hidden_size": HIDDEN,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": INTERMEDIATE,
            "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
            "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
            "position_embedding_type": "absolute"}


def write_random_checkpoint(family_name: str, config: dict, folder: str, seed: int = 0,
                            tokenizer: bool = True, extra: dict | None = None, std: float = 0.2) -> str:
    """A Hugging Face folder of `family_name` (infjax/models/registry.py) with `config` as its config.json and
    random weights from numpy (norm gains near 1, small biases, kernels and embeddings of standard deviation
    `std`: by default large enough that every tensor matters), written through infjax's name map; with
    `tokenizer`, MiniLM's tokenizer files. The same `seed` gives the same bytes; `extra`: {name: shape} of more
    random tensors that infjax does not read (a BERT pooler). Returns `folder` (created)."""
    import jax

    from infjax.models import registry
    from infjax.models.hf import files as hf_files
    from infjax.models.hf.names import abstract_params

    family = registry.FAMILIES[family_name]
    module = family.module(family.config.from_hf_dict(config))
    rng = np.random.default_rng(seed)
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract_params(module))
    leaves = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        if name.endswith("['scale']"):
            value = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif name.endswith("['bias']"):
            value = 0.02 * rng.standard_normal(leaf.shape)
        else:
            value = std * rng.standard_normal(leaf.shape)
        leaves.append(value.astype(np.float32))
    params = jax.tree_util.tree_unflatten(tree, leaves)
    os.makedirs(folder, exist_ok=True)
    tensors = family.to_hf(params, config)
    for name, shape in (extra or {}).items():
        tensors[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    hf_files.save_safetensors(folder, tensors, max_shard_size=1 << 40)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    if tokenizer:
        minilm = hf_files.embedded_minilm_path()
        for name in TOKENIZER_FILES:
            shutil.copy(os.path.join(minilm, name), os.path.join(folder, name))
    return folder


# Tiny configs of every family (MiniLM's tokenizer: vocabularies of 30522), for the tests that go through each.
FAMILY_CONFIGS = {
    "bert": hf_config(),
    "modernbert": {"architectures": ["ModernBertModel"], "model_type": "modernbert", "vocab_size": 30522,
                   "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 3,
                   "num_attention_heads": HEADS, "global_attn_every_n_layers": 3, "local_attention": 16,
                   "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102,
                   "cls_token_id": 101, "sep_token_id": 102},
    "llama": {"architectures": ["LlamaModel"], "model_type": "llama", "vocab_size": 30522, "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": 1, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "max_position_embeddings": 512, "tie_word_embeddings": False},
    # transformers reads MiniLM's files in a qwen2 folder as Qwen2Tokenizer, which adds <|endoftext|> as id 30522:
    # the table has rows past the vocabulary, as Qwen's own checkpoints have (151,936 rows, 151,665 tokens).
    "qwen2": {"architectures": ["Qwen2Model"], "model_type": "qwen2", "vocab_size": 30528, "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": 1, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
              "max_position_embeddings": 512, "tie_word_embeddings": True},
}


def write_tiny_bert(folder: str, seed: int = 0) -> str:
    """Write the tiny BERT into `folder` (created) and return it: a sentence-transformers folder as MiniLM's is
    (mean pooling, normalized, max_seq_length 256), with the tiny width, and a pooler as BertModel has."""
    from infjax.models.hf import files as hf_files

    pooler = {"pooler.dense.weight": (HIDDEN, HIDDEN), "pooler.dense.bias": (HIDDEN,)}   # as a bare BertModel has
    write_random_checkpoint("bert", hf_config(), folder, seed, extra=pooler)
    minilm = hf_files.embedded_minilm_path()
    for name in ST_FILES:
        shutil.copy(os.path.join(minilm, name), os.path.join(folder, name))
    with open(os.path.join(minilm, "1_Pooling", "config.json"), encoding="utf-8") as f:
        pooling = json.load(f)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w", encoding="utf-8") as f:
        json.dump({**pooling, "word_embedding_dimension": HIDDEN}, f, indent=2)
    return folder


def write_run_dir(workdir, step: int = 2, interaction: str = "concat", shared_encoder: bool = True,
                  noise: float = 0.02, overrides: dict | None = None) -> str:
    """An infjax run directory without training: the tiny BERT, its weights perturbed by `noise` (each tower
    differently when not `shared_encoder`), saved as checkpoint `step` of a run trained at 48 tokens whose
    synthetic evaluation split is seed 7, 3 queries, pools of 8 (and any other config `overrides`). Returns the
    folder."""
    import jax

    from infjax import config as config_lib
    from infjax.models.encoder import load_encoder
    from infjax.runtime import checkpoint
    from infjax.training import state as state_lib

    c = config_lib.base_config("multi_pi")
    c.model.checkpoint = tiny_bert_path()
    c.model.interaction = interaction
    c.model.shared_encoder = shared_encoder
    c.data.query_max_len = c.data.passage_max_len = 48
    c.data.synthetic.seed, c.data.synthetic.num_eval_queries, c.data.synthetic.pool_size = 7, 3, 8
    c = config_lib.override(c, overrides or {})
    _, params, _ = load_encoder(c.model)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: x + noise * rng.standard_normal(x.shape).astype(x.dtype), params)
    optimizer, _ = state_lib.make_optimizer(c.train, total_steps=1)
    ckpts = checkpoint.Checkpoints(str(workdir))
    ckpts.save(step, state_lib.create_state(params, optimizer, 0), {"step": step, "epoch": 0, "offset": 0},
               json.loads(c.to_json_best_effort()))
    ckpts.close()
    return str(workdir)


_PATH: list[str] = []


def tiny_bert_path() -> str:
    """The tiny BERT of this test process, written on first use into a temporary folder removed at exit (by
    `remove_tiny_bert` at the end of a pytest session, by atexit in a process the tests start)."""
    if not _PATH:
        import atexit
        import tempfile

        root = tempfile.mkdtemp(prefix="infjax-tiny-bert-")
        atexit.register(shutil.rmtree, root, True)
        _PATH.append(write_tiny_bert(os.path.join(root, "tiny-bert")))
    return _PATH[0]


def remove_tiny_bert() -> None:
    """Remove this process's tiny BERT, if it wrote one. pytest-xdist ends a worker that is slow to stop with
    os._exit, which runs no atexit handler; the session's end comes before that."""
    if _PATH:
        shutil.rmtree(os.path.dirname(_PATH.pop()), ignore_errors=True)
