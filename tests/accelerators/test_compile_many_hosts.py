"""A train step compiled for several hosts (JAX's compile-only topologies: 2 hosts of 8 H100s, a v5p slice of
2 hosts): the program each process of a multi-host job would run, its collectives crossing hosts. A tiny BERT
keeps each compile short; the paper's shapes on 4 x 8 H100s and v5p-128: docs/scale.md §6."""
import re

import pytest

from infjax import config as config_lib
from infjax.benchmarks import compile as bench_compile
from infjax.runtime import targets
from tests.helpers.targets import compile_only_devices, tiny_overrides


def config(root, **extra):
    return config_lib.override(config_lib.base_config("multi_pi"), {
        **tiny_overrides("bert", root), "model.dtype": "bfloat16", "train.batch_size": 16, "train.steps": 2,
        "data.synthetic.num_train": 64, "data.query_max_len": 64, "data.passage_max_len": 128,
        "loss.instruction_negatives": 1, "eval.synthetic": False, "eval.canary": "", **extra})


@pytest.mark.parametrize("name, hosts, mesh", [("h100x8", 2, {"mesh.data": 2, "mesh.fsdp": 8}),
                                               ("v5p-16", 1, {"mesh.data": 1, "mesh.fsdp": 8})])
def test_the_train_step_compiles_for_several_hosts(tmp_path, name, hosts, mesh):
    target, devices = compile_only_devices(name)           # (a skip where the target's compiler is missing)
    if hosts > 1:
        target = targets.parse(name, hosts)
        devices = targets.devices(target)
    assert target.hosts == 2 and len({d.process_index for d in devices}) == 2
    r = bench_compile.compile_step(config(tmp_path, **mesh), target, devices=devices)
    assert r.compiled is not None and r.fits and r.memory["temporaries"] > 0
    text = r.compiled.as_text()
    assert re.search(r"all-gather|all-reduce|reduce-scatter", text)        # fsdp's gathers and the gradients' sums
    assert r.as_dict()["hosts"] == 2 and r.as_dict()["devices"] == target.count
