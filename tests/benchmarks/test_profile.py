"""benchmarks/profile.py: a jax.profiler trace of a few steps, summarised by kernel (a real CPU trace, and the
layout of a GPU trace)."""
import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

from infjax.benchmarks import hlo, profile


def test_a_cpu_trace_of_three_steps_is_summarised_by_the_programs_kernels(tmp_path):
    @jax.jit
    def step(state, batch):
        h = jnp.tanh(batch @ state)
        return state - 0.01 * (batch.T @ h), {"loss": jnp.mean(h * h)}

    state, batch = jnp.ones((64, 64)) * 0.01, jnp.ones((256, 64))
    jax.block_until_ready(step(state, batch))                       # compiled and warm, as the benchmark does
    _, summary = profile.profile_steps(step, state, [batch] * 3, str(tmp_path))
    assert summary["device"] == "cpu" and summary["steps"] == 3
    assert 0 < summary["kernel_ms_per_step"] <= summary["wall_ms_per_step"] * 1.5
    assert 0 < summary["kernel_share"] <= 1.5 and summary["top"]
    assert summary["top"] == sorted(summary["top"], key=lambda r: -r["ms_per_step"])
    if summary["distinct_kernels"] <= profile.TOP:
        assert sum(r["share_of_kernel_time"] for r in summary["top"]) == pytest.approx(1.0)
    # what ran is what the program holds: every kernel named in the trace is an instruction of the step
    program = hlo.Program.parse(step.lower(state, batch).compile().as_text())
    names = {ins.name for c in program.computations.values() for ins in c}
    assert {r["name"] for r in summary["top"]} <= names, (summary["top"], sorted(names)[:20])
    assert all(r["calls_per_step"] == 1 for r in summary["top"])     # each kernel once per step, 3 steps
    assert "kernels" in profile.table(summary)


def _write_trace(folder, events):
    path = os.path.join(folder, "plugins", "profile", "run", "perfetto_trace.json.gz")
    os.makedirs(os.path.dirname(path))
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_a_gpu_trace_counts_the_stream_kernels_not_the_module_spans(tmp_path):
    """A GPU trace as the trace viewer lays it out: kernels on the device's stream threads, the XLA module's
    span over them on another thread of the device, the host's own work in its own process."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Modules"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "python"}}]
    events = list(meta)
    for step in range(2):
        t = step * 1000.0
        events += [{"ph": "X", "pid": 1, "tid": 8, "ts": t, "dur": 900.0, "name": "jit_train_step"},
                   {"ph": "X", "pid": 1, "tid": 7, "ts": t, "dur": 600.0, "name": "sm90_xmma_gemm_bf16"},
                   {"ph": "X", "pid": 1, "tid": 7, "ts": t + 600, "dur": 100.0, "name": "loop_add_fusion"},
                   {"ph": "X", "pid": 1, "tid": 7, "ts": t + 700, "dur": 50.0, "name": "loop_add_fusion"},
                   {"ph": "X", "pid": 2, "tid": 1, "ts": t, "dur": 950.0, "name": "PjitFunction(train_step)"}]
    _write_trace(str(tmp_path), events)
    summary = profile.summarize(profile.read_trace(str(tmp_path)), steps=2, wall_s=1e-3)
    assert summary["device"] == "gpu" and summary["kernels_per_step"] == 3 and summary["distinct_kernels"] == 2
    assert summary["kernel_ms_per_step"] == pytest.approx(0.75)
    assert summary["kernel_share"] == pytest.approx(0.75)
    top = summary["top"]
    assert [r["name"] for r in top] == ["sm90_xmma_gemm_bf16", "loop_add_fusion"]
    assert top[0]["ms_per_step"] == pytest.approx(0.6) and top[1]["calls_per_step"] == 2
    assert top[1]["ms_per_step"] == pytest.approx(0.15) and top[0]["share_of_kernel_time"] == pytest.approx(0.8)


def test_a_folder_without_a_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        profile.read_trace(str(tmp_path))
