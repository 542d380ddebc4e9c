"""infjax/inference/sources.py: a model's cache key, and the texts sentence-transformers cuts counted."""
import numpy as np

from infjax.data.tokenize import TextFormat


def test_a_runs_cache_key_is_its_weights_not_its_path():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from infjax.inference.sources import EmbeddingModel, params_digest
    from infjax.runtime.mesh import default_mesh

    params = {"layer": {"kernel": np.arange(64, dtype=np.float32).reshape(8, 8), "bias": np.zeros(8, np.float32)}}
    digest = params_digest(params)
    changed = {"layer": {**params["layer"], "bias": params["layer"]["bias"] + np.float32(1e-7)}}
    assert params_digest(changed) != digest
    mesh = default_mesh()
    sharded = jax.device_put(params, NamedSharding(mesh, P(mesh.axis_names[0])))      # rows over the devices
    assert params_digest(sharded) == digest
    calls = []
    model = EmbeddingModel("runs/x", "run", 3, TextFormat(), 8, 8, None, None,
                           cache_key=lambda: calls.append(1) or f"run:runs/x|weights={digest}")
    assert model.key() == model.key() == f"run:runs/x|weights={digest}" and calls == [1]     # computed once


def test_a_sentence_transformers_that_tokenizes_elsewhere_gives_an_unknown_count(caplog):
    """The count comes from the batches sentence-transformers tokenizes; where they do not add up to the texts
    encoded, the count is unknown (one warning), never a wrong number."""
    from infjax.inference.sources import st_counting
    from infjax.inference.truncation import Cuts

    class Elsewhere:
        def tokenize(self, texts):
            raise AssertionError("not called")

        def encode(self, texts):
            return np.zeros((len(texts), 4), np.float32)

    model, cuts = Elsewhere(), Cuts(16)
    with st_counting(model, cuts, 3):
        model.encode(["a", "b", "c"])
    assert (cuts.texts, cuts.cut_count) == (3, None) and "tokenize" not in vars(model)
    assert "sentence-transformers tokenized 0 texts through Elsewhere.tokenize for 3 encoded" in caplog.text
