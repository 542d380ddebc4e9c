"""Corpus encoding throughput: infjax (jit, length buckets, sharded) vs sentence-transformers (torch).

    python -m infjax.bench encode-corpus [--n 2000] [--batch_size 32] [--max_len 128]

Both encode the same N synthetic passages with the embedded
all-MiniLM-L6-v2, at the same batch size and max length, after a warm-up
(infjax: one full pass, which compiles every shape; sentence-transformers:
a few batches). Prints the median docs/s of --repeats passes for each side
with every run's figure, the share of real tokens in what each side
encodes, infjax's host time (tokenization, packing, transfer), the ratio
and the largest embedding difference. sentence-transformers runs on torch with all
its threads (`torch.get_num_threads()`); infjax on the default JAX devices.
"""
from __future__ import annotations

import time

import jax
import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from absl import flags

from infjax import cli
from infjax.config import base_config
from infjax.data import synthetic
from infjax.data.tokenize import Tokenizer
from infjax.inference.embedders import TextEmbedder
from infjax.models.encoder import load_encoder
from infjax.models.hf.files import embedded_minilm_path
from infjax.runtime.mesh import default_mesh, replicated


def synthetic_passages(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        topic = synthetic.TOPICS[int(rng.integers(len(synthetic.TOPICS)))]
        text = synthetic.passage_text(rng, topic, synthetic._random_attributes(rng))
        out.append(" ".join([text] * (1 + i % 4)))                 # varied lengths, as a real corpus
    return out


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("n", 2000, "passages to encode", flag_values=fv)
    flags.DEFINE_integer("batch_size", 32, "texts per batch on both sides (sentence-transformers' default); infjax "
                         "packs its calls by tokens (inference.embedders.tokens_per_call)", flag_values=fv)
    flags.DEFINE_integer("max_len", 128, "tokens per passage (truncation)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed passes per side (the median is reported)", flag_values=fv)
    flags.DEFINE_bool("padded", False, "also time infjax's padded length-bucket path", flag_values=fv)


def main(argv: list[str]) -> None:
    args = cli.parse("python -m infjax.bench encode-corpus", define_flags, argv, doc=__doc__.split("\n\n")[0])

    texts = synthetic_passages(args.n)
    encoder, params, path = load_encoder(base_config("multi_pi").model)
    mesh = default_mesh()
    params = jax.device_put(params["shared"], replicated(mesh))
    tokenizer = Tokenizer(path, encoder.padding_side)
    real = sum(len(t) for t in tokenizer.tokens(texts, args.max_len))

    def timed(embedder):
        ours = embedder(params, texts, args.max_len)              # warm-up: compiles every shape
        embedder.stats.update(real_tokens=0, buffer_tokens=0, host_s=0.0)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            ours = embedder(params, texts, args.max_len)
            times.append(time.perf_counter() - t)
        return ours, times

    sides = {"infjax": TextEmbedder(encoder, mesh, tokenizer, args.batch_size)}
    if args.padded:
        sides["infjax padded"] = TextEmbedder(encoder, mesh, tokenizer, args.batch_size, packed=False)
    results = {name: timed(e) for name, e in sides.items()}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = SentenceTransformer(embedded_minilm_path(), device=device)
    st.max_seq_length = args.max_len
    st.encode(texts[:4 * args.batch_size], batch_size=args.batch_size, normalize_embeddings=True)   # warm-up
    t_st = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        theirs = st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
        t_st.append(time.perf_counter() - t)
    # sentence-transformers pads each batch (texts sorted by characters) to its longest text
    order = np.argsort([-len(t) for t in texts], kind="stable")
    lengths = np.array([len(t) for t in tokenizer.tokens(texts, args.max_len)])
    st_buffer = sum(lengths[order[i:i + args.batch_size]].max() * len(order[i:i + args.batch_size])
                    for i in range(0, len(texts), args.batch_size))

    def rate(times):
        return f"{args.n / np.median(times):8.1f} docs/s (runs: {', '.join(f'{args.n / t:.1f}' for t in times)})"

    print(f"encode-corpus: {args.n} passages ({real} tokens), batch {args.batch_size}, max_len {args.max_len}, "
          f"all-MiniLM-L6-v2, median of {args.repeats}")
    for name, (ours, times) in results.items():
        e = sides[name]
        per_run = {k: v / args.repeats for k, v in e.stats.items()}
        share = f"{100 * per_run['real_tokens'] / per_run['buffer_tokens']:.0f}%" if per_run["buffer_tokens"] \
            else "n/a"
        print(f"  {name:22s} {rate(times)}  real-token share {share}, host {per_run['host_s']:.2f} s "
              f"of {np.median(times):.2f} s per run; max |diff| vs s-t {float(np.abs(ours - theirs).max()):.1e}")
    print(f"  {'sentence-transformers':22s} {rate(t_st)}  real-token share {100 * real / st_buffer:.0f}% "
          f"(torch on {device}, {torch.get_num_threads()} threads)")
    for name, (_, times) in results.items():
        print(f"  ratio {name} / sentence-transformers: {np.median(t_st) / np.median(times):.2f}x")
