"""infjax/inference/search.py: exact blocked top-k."""
import numpy as np
import pytest

from infjax.inference.search import search


@pytest.mark.parametrize("n, k, block", [(103, 10, 16), (50, 100, 16), (7, 3, 4), (1000, 37, 128), (64, 64, 64)])
def test_blocked_topk_equals_bruteforce_argsort(n, k, block):
    rng = np.random.default_rng(n)
    corpus = rng.integers(-2, 3, size=(n, 6)).astype(np.float32)      # small integers: many exact ties
    queries = rng.integers(-2, 3, size=(11, 6)).astype(np.float32)
    scores, idx = search(queries, corpus, k, block_size=block, query_block=5)
    full = queries @ corpus.T
    ref = np.argsort(-full, axis=1, kind="stable")[:, :min(k, n)]      # ties: lower index first
    np.testing.assert_array_equal(idx, ref)
    np.testing.assert_allclose(scores, np.take_along_axis(full, ref, 1))


def test_search_refuses_bad_shapes():
    with pytest.raises(ValueError, match="must be"):
        search(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32), 2)
