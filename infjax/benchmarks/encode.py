"""Forward throughput of each backbone family: `python -m infjax.bench encode [flags]`.

Builds a small random model per family (bert, modernbert, llama, qwen2) of
the same width and depth, compiles the forward pass once (warm-up), then
times ``--iters`` calls on a fixed [batch, seq_len] batch with
``jax.block_until_ready`` and prints tokens per second on the current device.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from infjax import cli
from infjax.models.bert import BertConfig, BertModel
from infjax.runtime import platform
from infjax.models.decoder import DecoderConfig, DecoderModel
from infjax.models.modernbert import ModernBertConfig, ModernBertModel

FAMILIES = ("bert", "modernbert", "llama", "qwen2")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def build(family: str, hidden: int, layers: int, heads: int, vocab: int, seq_len: int, dtype, remat=False,
          scan=False):
    """A random-architecture module of ``family`` (intermediate = 4 x hidden; GQA with heads // 2 kv heads)."""
    inter = 4 * hidden
    if family == "bert":
        return BertModel(BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=heads, intermediate_size=inter,
                                    max_position_embeddings=max(512, seq_len)), dtype=dtype, remat=remat)
    if family == "modernbert":
        types = tuple("full_attention" if i % 3 == 0 else "sliding_attention" for i in range(layers))
        return ModernBertModel(ModernBertConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                                num_hidden_layers=layers, num_attention_heads=heads,
                                                layer_types=types, local_attention=min(128, seq_len)),
                               dtype=dtype, remat=remat, scan_layers=scan)
    config = DecoderConfig(model_type=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads,
                           qkv_bias=family == "qwen2")
    return DecoderModel(config, dtype=dtype, remat=remat, scan_layers=scan)


def measure(module, batch: int, seq_len: int, vocab: int, iters: int) -> tuple[float, float]:
    """(compile + first call seconds, mean seconds per forward) for one module."""
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, vocab, size=(batch, seq_len)), jnp.int32)
    mask = jnp.ones_like(ids)
    params = jax.jit(lambda: module.init(jax.random.PRNGKey(0), ids, mask)["params"])()
    forward = jax.jit(lambda p, i, m: module.apply({"params": p}, i, m))
    start = time.perf_counter()
    jax.block_until_ready(forward(params, ids, mask))          # warm-up: compile
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(iters):
        out = forward(params, ids, mask)
    jax.block_until_ready(out)
    return warm, (time.perf_counter() - start) / iters


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("families", ",".join(FAMILIES), "comma-separated subset of " + ",".join(FAMILIES),
                        flag_values=fv)
    for name, default, text in (("hidden", 256, "hidden size"), ("layers", 4, "layers"), ("heads", 4, "heads"),
                                ("vocab", 1024, "vocabulary size"), ("batch", 16, "texts per call"),
                                ("seq_len", 128, "tokens per text"), ("iters", 10, "timed calls")):
        flags.DEFINE_integer(name, default, text, flag_values=fv)
    flags.DEFINE_enum("dtype", "float32", sorted(_DTYPES), "compute dtype", flag_values=fv)
    flags.DEFINE_bool("scan", False, "scan over layers (not bert)", flag_values=fv)


def main(argv: list[str]) -> None:
    args = cli.parse("python -m infjax.bench encode", define_flags, argv, doc=__doc__.splitlines()[0])
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        cli.fail("python -m infjax.bench encode", f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    print(f"device {platform.describe()}  batch {args.batch} x {args.seq_len} tokens  hidden "
          f"{args.hidden}  layers {args.layers}  heads {args.heads}  dtype {args.dtype}  iters {args.iters}")
    tokens = args.batch * args.seq_len
    for family in families:
        module = build(family, args.hidden, args.layers, args.heads, args.vocab, args.seq_len, _DTYPES[args.dtype],
                       scan=args.scan and family != "bert")
        warm, per_call = measure(module, args.batch, args.seq_len, args.vocab, args.iters)
        print(f"{family:<11} {tokens / per_call:>12,.0f} tokens/s  ({per_call * 1e3:8.2f} ms/forward, "
              f"compile {warm:.1f} s)")
