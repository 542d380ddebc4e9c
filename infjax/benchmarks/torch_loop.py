"""The PyTorch peer of `bench train --vs_torch`: a plain sentence-transformers training loop.

The parent writes the rows of every step (instruction-aware queries and passages) to a JSON file and
runs this module in a child process, so the child's max RSS is torch's alone:

    python -m infjax.benchmarks.torch_loop ROWS.json

Per step: tokenize both sides with dynamic padding (to the step's longest text, cut at the max
lengths), done before the timing as infjax's batches are; then forward through the
SentenceTransformer (its own pooling; dropout only if the infjax run uses it), in-batch softmax cross-entropy of
q . p^T / temperature, backward, gradient clipping at 1.0, AdamW. Prints one JSON line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from infjax.models.encoder import checkpoint_path
from infjax.runtime import cpu as runtime_cpu


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the parent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_in_child(steps: list[list[list[str]]], warmup: int, config) -> dict:
    """steps[i] = [queries, passages] of step i; returns the child's figures."""
    job = {"steps": steps, "warmup": warmup, "model": checkpoint_path(config.model.checkpoint),
           "query_max_len": config.data.query_max_len, "passage_max_len": config.data.passage_max_len,
           "temperature": config.loss.temperature, "learning_rate": config.train.learning_rate,
           "dropout": bool(config.model.dropout)}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        out = subprocess.run([sys.executable, "-m", "infjax.benchmarks.torch_loop", f.name], check=True,
                             capture_output=True, text=True, env=runtime_cpu.plain_env())
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(path: str) -> None:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    job = json.load(open(path))
    torch.manual_seed(0)
    model = SentenceTransformer(job["model"], device="cpu")
    model.train(job["dropout"])          # dropout as in the infjax run (model.dropout, off by default)
    tok = model.tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["learning_rate"], weight_decay=0.0)

    def features(texts, max_len):
        return dict(tok(texts, padding=True, truncation=True, max_length=max_len, return_tensors="pt"))

    batches = [(features(q, job["query_max_len"]), features(p, job["passage_max_len"])) for q, p in job["steps"]]
    timed_batches = batches[job["warmup"]:]                   # token counts: of the timed steps, as infjax's
    real = sum(int(b[s]["attention_mask"].sum()) for b in timed_batches for s in (0, 1))
    padded = sum(int(b[s]["attention_mask"].numel()) for b in timed_batches for s in (0, 1))
    times = []
    for q, p in batches:
        t0 = time.perf_counter()
        eq = torch.nn.functional.normalize(model(dict(q))["sentence_embedding"], dim=-1)
        ep = torch.nn.functional.normalize(model(dict(p))["sentence_embedding"], dim=-1)
        logits = eq @ ep.T / job["temperature"]
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    timed = times[job["warmup"]:]
    print(json.dumps({"step_s": float(np.median(timed)), "step_times": timed, "real_share": real / padded,
                      "tokens_per_step": padded / len(timed_batches),
                      "real_tokens_per_step": real / len(timed_batches), "threads": torch.get_num_threads(),
                      "max_rss_mib": peak_rss_mib()}))


if __name__ == "__main__":
    main(sys.argv[1])
