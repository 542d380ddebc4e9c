"""infjax/inference/truncation.py: the texts a tokenizer cuts, counted from its own calls."""
import numpy as np
import pytest

from tests.helpers.evaluation import SPLIT, _uncut_over, needs_minilm


@needs_minilm
@pytest.mark.parametrize("side", ["right", "left"])
def test_counting_gives_the_ids_of_the_tokenizers_own_methods(side, monkeypatch):
    """truncation.tokens / padded make Tokenizer.tokens' and Tokenizer.__call__'s call (left padding too, as the
    decoders pad), CHUNK texts at a time: the encoder reads the same ids whether it counts or not."""
    from infjax.data import tokenize
    from infjax.data.tokenize import Tokenizer
    from infjax.inference import truncation
    from infjax.inference.truncation import Cuts
    from infjax.models.hf.files import embedded_minilm_path

    tok = Tokenizer(embedded_minilm_path(), padding_side=side)
    texts = list(SPLIT.corpus.values()) + ["", "short", "word " * 14, "word " * 15]
    monkeypatch.setattr(tokenize, "CHUNK", 7)
    cuts, want = Cuts(16), _uncut_over(embedded_minilm_path(), texts, 16)
    ids = truncation.tokens(tok, texts, 16, cuts)
    assert [i.tolist() for i in ids] == [i.tolist() for i in tok.tokens(texts, 16)] and ids[0].dtype == np.int32
    padded, mask = truncation.padded(tok, texts, 16, cuts, len(texts) - 1)      # the last one pads a batch
    ref_ids, ref_mask = tok(texts, 16)
    np.testing.assert_array_equal(padded, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)
    assert padded.dtype == ref_ids.dtype and mask.dtype == ref_mask.dtype
    assert (cuts.texts, cuts.cut_count) == (2 * len(texts) - 1, 2 * want - 1)     # "word " * 15 is cut


@needs_minilm
def test_without_the_tokenizers_encodings_only_texts_that_fill_max_len_are_tokenized_again():
    """What older sentence-transformers (plain tensors) and slow tokenizers give: a cut text fills max_len, so
    those texts alone are tokenized again, uncut, to tell them from texts of exactly max_len tokens; rows that
    are not one per text give no count (None), never a guess."""
    from transformers import AutoTokenizer

    from infjax.inference.truncation import cut_flags
    from infjax.models.hf.files import embedded_minilm_path

    tok = AutoTokenizer.from_pretrained(embedded_minilm_path())
    texts = ["word " * 14, "word " * 15, "short", ""] + list(SPLIT.corpus.values())[:6]      # 16 and 17 tokens
    uncut = [len(ids) for ids in tok(texts)["input_ids"]]
    asked = []

    def lengths(batch):
        asked.extend(batch)
        return [len(ids) for ids in tok(batch)["input_ids"]]

    encoded = tok(texts, truncation=True, max_length=16)
    padded = tok(texts, truncation=True, max_length=16, padding="max_length", return_tensors="np")
    want = np.array(uncut) > 16
    np.testing.assert_array_equal(cut_flags(encoded, texts, 16, lengths), want)
    assert asked == []                                                    # the encodings say it
    np.testing.assert_array_equal(cut_flags(dict(encoded), texts, 16, lengths), want)
    np.testing.assert_array_equal(cut_flags(dict(padded), texts, 16, lengths), want)
    assert asked == 2 * [t for t, n in zip(texts, uncut) if n >= 16] and texts[0] in asked
    assert cut_flags({"input_ids": encoded["input_ids"][:3]}, texts, 16, lengths) is None
