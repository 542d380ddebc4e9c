"""The backbone families (infjax/models/registry.py): every family's Flax module and config offer what infjax
reads of a backbone (`Backbone`, `BackboneConfig`), and the tests' tiny checkpoints know every family."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from infjax.models import registry
from infjax.models.encoder import Encoder
from infjax.models.hf.names import abstract_params
from tests.helpers import backbones
from tests.helpers.tiny import hf_config

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {"bert": dict(hf_config(), **SMALL), "modernbert": dict(SMALL, model_type="modernbert", num_hidden_layers=3),
           "llama": dict(SMALL, model_type="llama", num_key_value_heads=2),
           "qwen2": dict(SMALL, model_type="qwen2", num_key_value_heads=2)}


def test_every_family_has_a_config_here():
    assert set(CONFIGS) == set(registry.FAMILIES)


@pytest.mark.parametrize("name", sorted(registry.FAMILIES))
def test_every_family_offers_what_infjax_reads_of_a_backbone(name):
    """The config parses HF's config.json, holds the fields the encoder and the kernels read and a `lora` field;
    the module is built with the keywords `Family.load` gives, offers the fields `Encoder` reads and clones, and
    its `apply` gives token states [N, L, hidden_size]."""
    family = registry.FAMILIES[name]
    config = family.config.from_hf_dict(CONFIGS[name], source=f"{name}/config.json")
    assert isinstance(config, registry.BackboneConfig)
    assert dataclasses.is_dataclass(config) and "lora" in {f.name for f in dataclasses.fields(config)}
    assert config.head_dim * config.num_attention_heads == config.hidden_size == 64
    module = family.module(config, dtype=jnp.bfloat16, residual="float32", remat="none", scan_layers=False)
    assert isinstance(module, registry.Backbone) and registry.of_module(module).module is family.module
    encoder = Encoder(module, family.default_pooling, family.padding_side, name)
    assert encoder.lora is None and encoder.remat == "none"
    assert encoder.with_remat("full").remat == "full"
    assert encoder.with_activation_sharding(None).without_lora().module.config.lora is None
    assert encoder.attention_row_multiple() in (None, *range(1, 1025))
    ids, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
    states = jax.eval_shape(lambda p: encoder.hidden(p, ids, mask, max_segments=1), abstract_params(module))
    assert states.shape == (2, 8, 64) and states.dtype == np.float32


def test_a_module_without_what_the_encoder_reads_is_no_backbone():
    class Bare(nn.Module):                        # a config, a dtype and remat, but no activation_sharding
        config: object
        dtype: object = jnp.float32
        residual: str = "float32"
        remat: str = "none"
        scan_layers: bool = False

        def __call__(self, ids, mask, deterministic=True):
            return ids

    config = registry.FAMILIES["bert"].config.from_hf_dict(CONFIGS["bert"])
    assert not isinstance(Bare(config), registry.Backbone)
    assert not isinstance(object(), registry.BackboneConfig)


def test_the_tests_tiny_checkpoints_know_every_family_and_refuse_another():
    """tests/helpers/backbones.py makes the tiny checkpoints of every family but BERT (tests/helpers/tiny.py's);
    a family it has no config for is refused, not given another family's."""
    assert set(backbones.FAMILIES) | {"bert"} == set(registry.FAMILIES)
    pytest.importorskip("transformers")
    for name in backbones.FAMILIES:
        assert backbones._hf_config(name).model_type == name
    with pytest.raises(ValueError, match=r"no tiny config for family 'mpnet'; it has \['modernbert', 'llama'"):
        backbones._hf_config("mpnet")
