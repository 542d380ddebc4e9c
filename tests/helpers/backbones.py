"""Tiny random Hugging Face checkpoints of the ModernBERT, Llama and Qwen2 backbones (from test_backbones),
each saved once per test session."""
import pytest

FAMILIES = ("modernbert", "llama", "qwen2")
VOCAB = 100
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4)
# Llama 3.2's RoPE schedule; with head_dim 16 the three frequency bands (kept, smoothed, divided) all occur.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _hf_config(family):
    """The tiny transformers config of `family` (one of FAMILIES); another family is refused, naming them."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"tests/helpers/backbones.py has no tiny config for family {family!r}; it has "
                         f"{list(FAMILIES)} (the tiny BERT is tests/helpers/tiny.py's)")
    if family == "modernbert":       # window 4 each side < 16 tokens: the local layers are really local
        return transformers.ModernBertConfig(**COMMON, num_hidden_layers=3, global_attn_every_n_layers=2,
                                             local_attention=8, global_rope_theta=1000.0, local_rope_theta=50.0,
                                             pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                             sep_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_theta=500000.0,
                                        rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=True)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_theta=10000.0,
                                        tie_word_embeddings=False)
    raise AssertionError(f"FAMILIES names {family!r} but _hf_config has no config for it")


def _perturb(model, seed=0):
    """Non-trivial norms and biases (HF inits them to 1 / 0) and larger weights, so every tensor matters."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("bias") or p.ndim == 1:
                p.add_(0.2 * noise)
            else:
                p.mul_(3.0)


_CACHE = {}


def write_word_tokenizer(folder, size):
    """A word-level tokenizer of `size` tokens (<unk>, <s>, </s>, then w3, w4, ...) saved into `folder`: a model
    folder is usable with the tokenizer it was trained with (infjax/models/folder.py), here one of its size."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                         pad_token="<unk>").save_pretrained(folder)
    return folder


def tiny_checkpoint(family, tmp_path_factory):
    """(folder, torch model in eval mode) of a random tiny HF model saved as safetensors."""
    if family not in _CACHE:
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = _hf_config(family)
        model = transformers.AutoModel.from_config(config, attn_implementation="eager").eval()
        _perturb(model)
        folder = str(tmp_path_factory.mktemp(f"tiny_{family}"))
        model.save_pretrained(folder, safe_serialization=True)
        write_word_tokenizer(folder, VOCAB)
        _CACHE[family] = folder, model
    return _CACHE[family]
