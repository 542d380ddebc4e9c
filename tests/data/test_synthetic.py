"""infjax/data/synthetic.py: the synthetic corpus and its FollowIR-style evaluation split."""
from infjax.data import synthetic
from infjax.data.inf_ir import FIELDS


def test_synthetic_is_deterministic_for_a_seed():
    a_train, a_eval = synthetic.make_synthetic(3, 50, 10)
    b_train, b_eval = synthetic.make_synthetic(3, 50, 10)
    c_train, _ = synthetic.make_synthetic(4, 50, 10)
    assert a_train == b_train and a_eval == b_eval
    assert a_train != c_train


def test_synthetic_records_follow_the_schema():
    records, _ = synthetic.make_synthetic(0, 200, 5)
    for r in records:
        assert set(r) == set(FIELDS) and all(isinstance(v, str) and v for v in r.values())
        assert r["instruction_positive"] != r["instruction_negative"]
        assert r["query_positive"] != r["query_negative"]
        assert "\n" not in r["instruction_positive"] + r["query_positive"]


def test_train_and_eval_share_no_query_or_topic():
    train, split = synthetic.make_synthetic(0, 2000, 45)
    train_queries = {r["query_positive"] for r in train} | {r["query_negative"] for r in train}
    assert not train_queries & set(split.queries.values())
    train_topics, eval_topics = synthetic.split_topics(0)
    assert not set(train_topics) & set(eval_topics)
    for r in train:
        assert not any(t in r["query_positive"] or t in r["document_positive"] for t in eval_topics)


def test_instruction_decides_relevance_in_eval_split():
    """Each query: some documents lose relevance under the changed instruction, none gain it."""
    _, split = synthetic.make_synthetic(0, 10, 30)
    for q, pool in split.candidates.items():
        og, new = split.qrels_og[q], split.qrels_changed[q]
        assert set(pool) == set(og) == set(new)
        assert any(og[d] and not new[d] for d in pool)        # relevance changes
        assert not any(new[d] and not og[d] for d in pool)    # changed instruction is stricter
        assert any(new[d] for d in pool)
        assert split.instructions_og[q] != split.instructions_changed[q]
