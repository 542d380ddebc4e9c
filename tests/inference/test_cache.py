"""infjax/inference/cache.py: an entry is used only when it holds the rows it was written with."""
import json
import shutil

import numpy as np
import pytest

from infjax.inference.cache import EmbeddingCache
from tests.helpers.evaluation import fake_embed


# --------------------------------------------------------------------------
# An entry: used only when it holds the rows it was written with
# --------------------------------------------------------------------------

TEXTS = ["one text", "two texts", "three texts here", "four"]


def _entry(cache_dir, side="passage"):
    """(the .npy path, the .json path) of the one entry of `side`."""
    for path in cache_dir.glob("*.json"):
        if json.loads(path.read_text())["side"] == side:
            return path.with_suffix(".npy"), path
    raise AssertionError(f"no {side} entry")


def _permuted(npy, _):
    np.save(npy, np.load(npy)[::-1].copy())


def _cut(npy, _):
    npy.write_bytes(npy.read_bytes()[:-10])


def _pickled(npy, _):
    rows = np.load(npy)
    np.save(npy, np.array([*rows, None], dtype=object)[:-1], allow_pickle=True)


def _wider(npy, _):
    rows = np.load(npy)
    np.save(npy, np.concatenate([rows, rows], axis=1))


def _swapped(npy, described):
    """Another entry's pair of files (the query side's, of as many texts) in this entry's place."""
    other_npy, other_json = _entry(npy.parent, "query")
    shutil.copy(other_npy, npy)
    shutil.copy(other_json, described)


def _swapped_rows(npy, _):
    """Another entry's rows (same shape) under this entry's description."""
    shutil.copy(_entry(npy.parent, "query")[0], npy)


def _older(_, described):
    """As an infjax that kept no digest of the rows wrote it."""
    entry = json.loads(described.read_text())
    del entry["rows"]
    described.write_text(json.dumps(entry))


def _no_description(_, described):
    described.unlink()


DAMAGE = {"permuted rows": (_permuted, "its rows are not the ones it was written with"),
          "cut": (_cut, "it is cut short: "),
          "pickled": (_pickled, "it holds pickled Python objects, which the cache never loads"),
          "another width": (_wider, "rows of width 128, its description (.json) says [4, 64] float32"),
          "another entry's files": (_swapped, "its description (.json) is of another entry (side 'query'"),
          "another entry's rows": (_swapped_rows, "its rows are not the ones it was written with"),
          "an older infjax's": (_older, "keeps no digest of its rows"),
          "no description": (_no_description, "cannot be read (FileNotFoundError)")}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_a_miss_in_one_line_and_written_again(tmp_path, caplog, damage):
    """An entry that does not hold the rows it was written with (permuted, cut, pickled, wider, another
    entry's, of an older infjax, without its description) is a miss: one warning naming it and why, the rows
    computed again and written again, never read (permuted rows once scored 0.0900 for 0.1896)."""
    calls = []

    def embed(texts):
        calls.append(len(texts))
        return fake_embed(texts)

    cache = EmbeddingCache(str(tmp_path))
    passages = cache.wrap(embed, "m", None, "beir:x", "passage")
    queries = cache.wrap(lambda texts: fake_embed(texts[::-1]), "m", None, "beir:x", "query")
    expected = passages(TEXTS)
    queries(TEXTS)
    npy, described = _entry(tmp_path)
    make, why = DAMAGE[damage]
    make(npy, described)
    with caplog.at_level("WARNING", logger="infjax.inference"):
        again = passages(TEXTS)
    np.testing.assert_array_equal(again, expected)
    assert calls == [4, 4]                                             # computed again, not read
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(f"embedding cache entry {npy} is not used: ")
    assert why in warnings[0] and warnings[0].endswith("; computing it again")
    caplog.clear()
    np.testing.assert_array_equal(passages(TEXTS), expected)           # written again: a hit
    assert calls == [4, 4] and not [r for r in caplog.records if r.levelname == "WARNING"]


def test_an_entry_read_back_is_writable_and_its_texts_in_order(tmp_path):
    cache = EmbeddingCache(str(tmp_path))
    cached = cache.wrap(fake_embed, "m", None, "beir:x", "passage")
    first = cached(TEXTS)
    hit = cached(TEXTS)
    assert hit.flags.writeable and hit.dtype == np.float32
    np.testing.assert_array_equal(hit, first)
    reordered = cached(TEXTS[::-1])                                   # other texts' order: another key
    np.testing.assert_array_equal(reordered, fake_embed(TEXTS[::-1]))


def test_embedding_cache_keys_on_texts(tmp_path):
    from infjax.inference.cache import EmbeddingCache

    calls = []

    def embed(texts):
        calls.append(list(texts))
        return fake_embed(texts)

    cached = EmbeddingCache(str(tmp_path)).wrap(embed, "m", 3, "beir:x", "passage")
    a = cached(["one text", "two texts"])
    b = cached(["one text", "two texts"])
    np.testing.assert_array_equal(a, b)
    assert len(calls) == 1
    cached(["one text", "two text"])
    other_step = EmbeddingCache(str(tmp_path)).wrap(embed, "m", 4, "beir:x", "passage")
    other_step(["one text", "two texts"])
    assert len(calls) == 3
