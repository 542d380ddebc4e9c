"""Corpus encoding throughput: infjax (jit, length buckets, sharded) vs sentence-transformers (torch).

    python -m infjax.bench encode-corpus [--n 2000] [--batch_size 64] [--max_len 128]

Both encode the same N synthetic passages with the embedded
all-MiniLM-L6-v2, at the same batch size and max length, after a warm-up
(infjax: one full pass, which compiles every length bucket; sentence-
transformers: a few batches). Prints docs/s for each, their ratio and the
largest embedding difference. sentence-transformers runs on torch with all
its threads (`torch.get_num_threads()`); infjax on the default JAX devices.
On a shared machine the figures are noisy: repeat with --repeats.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from infjax.config import base_config
from infjax.data import synthetic
from infjax.data.tokenize import Tokenizer
from infjax.inference.embedders import TextEmbedder
from infjax.models.encoder import load_encoder
from infjax.models.hf_io import embedded_minilm_path
from infjax.training.mesh import default_mesh, replicated


def synthetic_passages(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        topic = synthetic.TOPICS[int(rng.integers(len(synthetic.TOPICS)))]
        text = synthetic.passage_text(rng, topic, synthetic._random_attributes(rng))
        out.append(" ".join([text] * (1 + i % 4)))                 # varied lengths, as a real corpus
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m infjax.bench encode-corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000, help="passages to encode")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--max_len", type=int, default=128, help="tokens per passage (truncation)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per library (the best is reported)")
    args = p.parse_args(argv)

    texts = synthetic_passages(args.n)

    encoder, params, path = load_encoder(base_config("multi_pi").model)
    mesh = default_mesh()
    params = jax.device_put(params["shared"], replicated(mesh))
    embedder = TextEmbedder(encoder, mesh, Tokenizer(path, encoder.padding_side), args.batch_size)
    ours = embedder(params, texts, args.max_len)                  # warm-up: compiles every bucket
    t_ours = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        ours = embedder(params, texts, args.max_len)
        t_ours.append(time.perf_counter() - t)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = SentenceTransformer(embedded_minilm_path(), device=device)
    st.max_seq_length = args.max_len
    st.encode(texts[:4 * args.batch_size], batch_size=args.batch_size, normalize_embeddings=True)   # warm-up
    t_st = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        theirs = st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
        t_st.append(time.perf_counter() - t)

    ours_rate, st_rate = args.n / min(t_ours), args.n / min(t_st)
    print(f"encode-corpus: {args.n} passages, batch {args.batch_size}, max_len {args.max_len}, all-MiniLM-L6-v2")
    print(f"  infjax               {ours_rate:9.1f} docs/s   ({jax.device_count()} {jax.default_backend()} "
          f"device(s), batch padded to {embedder.batch_size})")
    print(f"  sentence-transformers {st_rate:8.1f} docs/s   (torch on {device}, {torch.get_num_threads()} threads)")
    print(f"  ratio infjax / sentence-transformers: {ours_rate / st_rate:.2f}x")
    print(f"  max |embedding difference|: {float(np.abs(ours - np.asarray(theirs)).max()):.2e}")
