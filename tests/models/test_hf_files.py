"""infjax/models/hf/files.py: the streaming safetensors writer."""
import os

import numpy as np
import pytest

from infjax.models.hf import files as hf_files


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
