"""Peak memory of export and of the evaluation restore, for a run of a large decoder shape.

    python -m infjax.bench export                       # ~300M-parameter Qwen2 shape, random init
    python -m infjax.bench export --tree=/path/to/older/checkout   # the same run through another checkout too

Builds a random-init Hugging Face base folder (config.json, safetensors, a word-level tokenizer), saves one
checkpoint of a run on it (parameters and AdamW moments, as training saves them), then in child processes
(peak resident memory = the child's ru_maxrss from wait4):
  export   `python -m infjax.export --workdir RUN --out OUT`
  restore  `load_run(RUN)` onto the default mesh, as `infjax.evaluate --model=RUN` does
and checks that the exported tensors equal the saved parameters bit for bit. Target: export's peak <= 1.5 x the
float32 parameter bytes + 1 GiB.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags

from infjax import cli, config as config_lib
from infjax.models.hf import files as hf_files
from infjax.models import decoder
from infjax.models.decoder import DecoderConfig, DecoderModel
from infjax.models.encoder import load_encoder
from infjax.runtime import checkpoint

from infjax.training import state as state_lib

GIB = 2**30


def define_flags(fv: flags.FlagValues) -> None:
    for name, default, text in (("hidden", 1024, "hidden size"), ("layers", 24, "layers"),
                                ("intermediate", 2816, "MLP size"), ("heads", 16, "query heads"),
                                ("kv_heads", 4, "key/value heads"), ("vocab", 32000, "vocabulary size")):
        flags.DEFINE_integer(name, default, f"the random Qwen2 base: {text}", flag_values=fv)
    flags.DEFINE_string("dir", None, "where the base folder, run and exports go (default: a temp dir)",
                        flag_values=fv)
    flags.DEFINE_multi_string("tree", [], "also run the children from this source checkout (PYTHONPATH), e.g. an "
                              "older commit", flag_values=fv)


def _flags(argv):
    return cli.parse("python -m infjax.bench export", define_flags, argv, doc=__doc__.split("\n\n")[0])


def build_base(folder: str, a) -> int:
    """A random Qwen2 base folder of the requested shape; returns its parameter count."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                      num_key_value_heads=a.kv_heads, tie_word_embeddings=False)
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    hf = hf_files.load_hf_config(folder)
    module = DecoderModel(DecoderConfig.from_hf_dict(hf, folder))
    ids = np.zeros((1, 1), np.int32)
    params = jax.jit(lambda: module.init(jax.random.PRNGKey(0), ids, np.ones_like(ids)))()["params"]
    params = jax.tree.map(np.asarray, params)
    hf_files.save_safetensors(folder, decoder.HF_NAMES.to_hf(params, module.config), 5 * 10**9)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, a.vocab)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                         pad_token="<eos>").save_pretrained(folder)
    return sum(int(x.size) for x in jax.tree.leaves(params))


def save_run(workdir: str, base: str) -> None:
    """One checkpoint (step 1) of a run on `base`, as training writes it: parameters, AdamW moments, config."""
    config = config_lib.base_config("multi_pi")
    config.model.checkpoint = base
    encoder, params, _ = load_encoder(config.model)
    optimizer, _ = state_lib.make_optimizer(config.train, total_steps=10)
    state = state_lib.create_state(params, optimizer, 0)
    ckpts = checkpoint.Checkpoints(workdir)
    ckpts.save(1, state, {"epoch": 0, "offset": 1}, json.loads(config.to_json_best_effort()))
    ckpts.close()


PEAK = ("import atexit, runpy, sys\n"
        "def peak():\n"
        "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
        "    print('VmHWM_KIB', hwm, flush=True)\n"
        "atexit.register(peak)\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def child(module: str, args: list[str], tree: str | None) -> dict:
    """`python -m module args` in a child; its wall time and peak resident memory (its own VmHWM, read at
    exit: a child's ru_maxrss would include this parent's peak, inherited across fork)."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PEAK, module, *args], env=env, capture_output=True, text=True,
                          cwd=os.path.abspath(tree) if tree else None)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    hwm = [int(line.split()[1]) for line in lines if line.startswith("VmHWM_KIB")]
    return {"rc": proc.returncode, "wall_s": time.perf_counter() - start,
            "peak_gib": hwm[-1] * 1024 / GIB if hwm else float("nan"),
            "tail": [line for line in lines if not line.startswith("VmHWM_KIB")][-2:]}


def exported_equal(out: str, base: str) -> bool:
    """The export's tensors equal, bit for bit, the parameters the run saved: those of the base folder, which
    the run's only checkpoint holds unchanged (read with safetensors, apart from any infjax restore code)."""
    got, want = hf_files.read_safetensors(out), hf_files.read_safetensors(base)
    return set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in want)


def main(argv: list[str]) -> None:
    a = _flags(argv)
    root = a.dir or tempfile.mkdtemp(prefix="infjax-bench-export-")
    base, workdir = os.path.join(root, "base"), os.path.join(root, "run")
    t = time.perf_counter()
    count = build_base(base, a) if not os.path.isdir(base) else None
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        save_run(workdir, base)
    if count is None:
            count = sum(int(v.size) for v in hf_files.read_safetensors(base).values())
    param_gib = count * 4 / GIB
    print(f"qwen2 shape: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: {count / 1e6:.1f}M parameters, "
          f"{param_gib:.2f} GiB float32 (built in {time.perf_counter() - t:.0f} s, in {root})")
    print(f"target: export peak <= 1.5 x {param_gib:.2f} + 1 = {1.5 * param_gib + 1:.2f} GiB")
    for tree in [None] + a.tree:
        name = tree or "this checkout"
        out = os.path.join(root, f"export-{len(os.listdir(root))}")
        e = child("infjax.export", ["--workdir", workdir, "--out", out], tree)
        r = child("infjax.benchmarks.restore_run", [workdir], tree)
        same = exported_equal(out, base) if e["rc"] == 0 else False
        print(f"{name}: export peak {e['peak_gib']:.2f} GiB ({e['peak_gib'] / param_gib:.2f}x params), "
              f"{e['wall_s']:.1f} s, rc {e['rc']}, tensors equal the saved parameters: {same}; "
              f"evaluation restore peak {r['peak_gib']:.2f} GiB, {r['wall_s']:.1f} s, rc {r['rc']}")
        for c in (e, r):
            if c["rc"] != 0:
                print("   ", c["tail"])
