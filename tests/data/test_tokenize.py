"""infjax/data/tokenize.py: the query template, the prefixes and tokenizing in chunks."""
import pytest

from infjax.data.tokenize import TextFormat, validate_template


def test_query_template_and_prefixes():
    fmt = TextFormat("{instruction} {query}", "query: ", "passage: ")
    assert fmt.query("Be strict.", "what is x") == "query: Be strict. what is x"
    assert fmt.passage("text") == "passage: text"
    assert TextFormat().query("I", "Q") == "Q I"
    with pytest.raises(ValueError, match="data.query_template"):
        validate_template("{query}")


def test_tokenizing_in_chunks_gives_what_one_call_gives(monkeypatch):
    """The tokenizer's calls of at most tokenize.CHUNK texts: ids and lengths equal one call's."""
    from infjax.data import tokenize
    from tests.helpers.tiny import tiny_bert_path

    tok = tokenize.Tokenizer(tiny_bert_path())
    texts = [f"text number {i} " + "word " * (i % 13) for i in range(23)]
    whole = (tok.tokens(texts, 9), tok.lengths(texts))
    direct = tok._tok(texts, truncation=True, max_length=9)["input_ids"]
    monkeypatch.setattr(tokenize, "CHUNK", 5)
    chunked = (tok.tokens(texts, 9), tok.lengths(texts))
    assert [t.tolist() for t in chunked[0]] == [t.tolist() for t in whole[0]] == direct
    assert chunked[1] == whole[1] and tok.tokens([], 9) == []
