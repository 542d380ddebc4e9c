"""The paper's shapes without downloads: records with InF-IR's text lengths, and checkpoint folders without weights.

The checkpoint folders are of the paper's backbones, holding a config.json and a tokenizer but no weights (load
them with weights=False and draw the parameters, or only compile).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from infjax.data import synthetic
from infjax.models.hf import files as hf_files

# Tokenizer files copied next to a generated config.json (the embedded MiniLM's BERT wordpiece tokenizer: ids
# below 30522, so it serves every vocabulary at least that large).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
WORDPIECE_VOCAB = 635      # see write_tokenizer

BERT_BASE = dict(model_type="bert", architectures=["BertModel"], hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072, vocab_size=30522, max_position_embeddings=512,
                 type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12, hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, pad_token_id=0)
E5_LARGE = dict(BERT_BASE, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
QWEN25_15B = dict(model_type="qwen2", architectures=["Qwen2Model"], hidden_size=1536, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  hidden_act="silu", pad_token_id=0)
QWEN25_7B = dict(QWEN25_15B, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                 vocab_size=152064, tie_word_embeddings=False)
# --shape of `bench train`: config.json contents and whether the model is a decoder (last-token pooling,
# remat and scanned layers, as the decoder presets)
SHAPES = {"bert-base": (BERT_BASE, False), "e5-large": (E5_LARGE, False), "qwen2.5-1.5b": (QWEN25_15B, True),
          "qwen2.5-7b": (QWEN25_7B, True)}



def inf_ir_shaped_records(n: int, seed: int = 0) -> list[dict]:
    """n records whose texts have InF-IR msmarco-like lengths in words (~1.3 MiniLM tokens per word).

    query: 4 + Poisson(5) words (~12 tokens); instruction: 12 + Poisson(14) words (~34 tokens), so
    template(I, Q) is ~45 tokens; passage: lognormal, median 110 words, sigma 0.5 (mean ~125 words,
    ~165 tokens, a long tail past 256). Words are drawn from the synthetic corpus's vocabulary.
    """
    vocab = sorted({w for t in synthetic.TOPICS + synthetic.CONTEXTS + synthetic.QUERY_TEMPLATES
                    + synthetic.INSTRUCTION_OPENERS for w in str(t).replace("{", " ").replace("}", " ").split()})
    rng = np.random.default_rng(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(vocab, size=max(int(words), 1)))

    def passage() -> str:
        return text(rng.lognormal(np.log(110), 0.5))

    return [{"query_positive": text(4 + rng.poisson(5)), "query_negative": text(4 + rng.poisson(5)),
             "instruction_positive": text(12 + rng.poisson(14)), "instruction_negative": text(12 + rng.poisson(14)),
             "document_positive": passage(), "hard_negative_document_1": passage(),
             "hard_negative_document_2": passage()} for _ in range(n)]


DECODER_TYPES = ("llama", "qwen2")     # their own tokenizer classes (transformers picks them by model_type)
BYTE_BPE_VOCAB = 875    # see write_byte_bpe_tokenizer


def checkpoint_folder(hf_config: dict, root: str) -> str:
    """A checkpoint folder with `hf_config` as config.json and a tokenizer, but no weights.

    No weights: load it with weights=False and fill the params with `random_params`. The tokenizer is a BERT WordPiece
    one (`tokenizer_source`), or for the decoders a byte-level BPE one that their own tokenizer classes read, which
    transformers picks for them whatever tokenizer_config.json says (given WordPiece files, Qwen2's splits text into
    single characters)."""
    folder = tempfile.mkdtemp(prefix=f"{hf_config['model_type']}_", dir=root)
    decoder = hf_config["model_type"] in DECODER_TYPES
    tokenizer = os.path.join(root, "tokenizer_bpe" if decoder else "tokenizer")
    if not os.path.isdir(tokenizer):
        (write_byte_bpe_tokenizer if decoder else write_tokenizer)(tokenizer)
    for name in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, name), folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return folder


def tokenizer_source() -> str:
    """The embedded MiniLM's tokenizer when its package is installed, else one trained here (the ~90 MB
    package is not needed on an accelerator machine to measure)."""
    try:
        hf_files.embedded_minilm_path()
        return "all-MiniLM-L6-v2"
    except Exception:   # noqa: BLE001 - not installed
        return "wordpiece trained on the benchmark's vocabulary"


def write_tokenizer(folder: str) -> None:
    """`tokenizer_source()` into `folder`. The trained one (WordPiece, `WORDPIECE_VOCAB` pieces) is sized so that
    the benchmark's texts get the token counts MiniLM gives them (within 3%), so the shapes stay the paper's."""
    os.makedirs(folder)
    if tokenizer_source() == "all-MiniLM-L6-v2":
        src = hf_files.embedded_minilm_path()
        for name in TOKENIZER_FILES:
            shutil.copy(os.path.join(src, name), folder)
        return
    import transformers
    from tokenizers import BertWordPieceTokenizer

    texts = [r[k] for r in inf_ir_shaped_records(200, seed=7) for k in ("query_positive",
                                                                                  "instruction_positive",
                                                                                  "document_positive")]
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(texts, vocab_size=WORDPIECE_VOCAB, min_frequency=1, show_progress=False)
    transformers.BertTokenizerFast(tokenizer_object=tok._tokenizer, do_lower_case=True).save_pretrained(folder)


def write_byte_bpe_tokenizer(folder: str) -> None:
    """A byte-level BPE tokenizer (GPT-2 / Qwen2 files) trained on the benchmark's vocabulary.

    Its files are tokenizer.json, vocab.json and merges.txt; `BYTE_BPE_VOCAB` pieces: sized so that the benchmark's
    texts get the token counts the embedded MiniLM gives them (within 3%), so the decoder shapes are the paper's
    lengths too."""
    import transformers
    from tokenizers import ByteLevelBPETokenizer

    os.makedirs(folder)
    texts = [r[k] for r in inf_ir_shaped_records(200, seed=7) for k in ("query_positive", "instruction_positive",
                                                                           "document_positive")]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=BYTE_BPE_VOCAB, min_frequency=1, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    tok.save_model(folder)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")
    fast.save_pretrained(folder)
