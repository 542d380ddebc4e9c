"""infjax/data/batches.py: the batch plan, the instruction-negative sampler, a step's rows and host slices."""
import numpy as np
import pytest

from infjax.data import batches, pipeline, synthetic
from infjax.data.inf_ir import FIELDS
from infjax.data.tokenize import TextFormat
from infjax.models.encoder import load_encoder
from infjax.training import setup as setup_lib
from tests.helpers.configs import small_config


def test_batch_plan_is_a_permutation_per_epoch():
    plan = batches.BatchPlan(num_records=10, batch_size=3, seed=1)
    assert plan.steps_per_epoch == 3
    epoch0 = np.concatenate([plan.record_indices(s) for s in range(3)])
    epoch1 = np.concatenate([plan.record_indices(s) for s in range(3, 6)])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert not np.array_equal(epoch0, epoch1)
    np.testing.assert_array_equal(plan.record_indices(4), batches.BatchPlan(10, 3, 1).record_indices(4))
    assert plan.position(4) == {"step": 4, "epoch": 1, "offset": 1}


def test_batch_plan_refuses_too_few_records():
    with pytest.raises(ValueError, match="fewer than one batch"):
        batches.BatchPlan(num_records=2, batch_size=3, seed=0)


def test_sampler_never_returns_own_instruction_and_is_deterministic():
    sampler = batches.InstructionNegativeSampler(pool_size=6, k=4, seed=0)
    own = np.array([0, 1, 0, 5, 2] * 20)
    for step in range(30):
        drawn = sampler.draw(step, own)
        assert drawn.shape == (100, 4) and (drawn >= 0).all() and (drawn < 6).all()
        np.testing.assert_array_equal(drawn, sampler.draw(step, own))
        for o, negs in zip(own, drawn):
            assert o not in negs and len(set(negs.tolist())) == 4
    assert not np.array_equal(sampler.draw(0, own), sampler.draw(1, own))
    np.testing.assert_array_equal(batches.InstructionNegativeSampler(6, 4, 0).draw(5, own), sampler.draw(5, own))


def test_sampler_draws_every_set_of_k_equally_often():
    """Floyd's algorithm: for a row, every K-subset of the other instructions is equally likely (chi-square over
    the 10 subsets of 2 of 5 candidates, 20,000 draws; the bound is the 0.999 quantile for 9 degrees of
    freedom), and a row's draw does not depend on the other rows' own instructions."""
    sampler = batches.InstructionNegativeSampler(pool_size=6, k=2, seed=3)
    own = np.full(2000, 4)
    counts = {}
    for step in range(10):
        for pair in sampler.draw(step, own):
            key = tuple(sorted(pair.tolist()))
            counts[key] = counts.get(key, 0) + 1
    assert set(counts) == {(a, b) for a in (0, 1, 2, 3, 5) for b in (0, 1, 2, 3, 5) if a < b}
    expected = 20000 / 10
    assert sum((n - expected) ** 2 / expected for n in counts.values()) < 27.88
    mixed = own.copy()
    mixed[1:] = 0
    assert sampler.draw(7, mixed)[0].tolist() == sampler.draw(7, own)[0].tolist()


def test_sampler_refuses_k_larger_than_pool():
    with pytest.raises(ValueError, match="loss.instruction_negatives=3"):
        batches.InstructionNegativeSampler(pool_size=3, k=3, seed=0)


def _store(records, query_max_len=160, passage_max_len=200, **encoding):
    from infjax.data import token_store
    from tests.helpers.tiny import tiny_bert_path

    return token_store.in_memory(records, tiny_bert_path(), token_store.Encoding(query_max_len, passage_max_len,
                                                                                  **encoding))


def _texts(records, fmt=TextFormat()):
    from infjax.data.tokenize import Tokenizer
    from tests.helpers.tiny import tiny_bert_path

    return batches.Texts(records, Tokenizer(tiny_bert_path()), fmt)


def test_the_instruction_pool_is_the_distinct_instructions_in_order():
    """The pool lists each distinct instruction text once, I+ then I- of each record in order; a record's own
    indices point at its texts."""
    records, _ = synthetic.make_synthetic(0, 6, 2)
    texts = [("A x", "B x"), ("A x", "C x"), ("B x", "D x"), ("E x", "A x"), ("C x", "F x"), ("G x", "A x")]
    for r, (a, b) in zip(records, texts):
        r["instruction_positive"], r["instruction_negative"] = a, b
    store = _store(records)
    pool = [records[int(p) // 7][FIELDS[int(p) % 7]] for p in store.pool]
    assert pool == ["A x", "B x", "C x", "D x", "E x", "F x", "G x"]
    for r, own in zip(records, np.asarray(store.own)):
        assert [pool[own[0]], pool[own[1]]] == [r["instruction_positive"], r["instruction_negative"]]


def test_host_slices_concatenate_to_the_global_batch():
    records, _ = synthetic.make_synthetic(0, 40, 2)
    store = _store(records)
    plan = batches.BatchPlan(len(store), 4, seed=0)
    sampler = batches.InstructionNegativeSampler(len(store.pool), 2, seed=0)

    def builder(pid, count):
        return batches.BatchBuilder(batches.StepTexts(store, plan, 160, 200, sampler=sampler, process_index=pid,
                                                      process_count=count))

    whole = builder(0, 1)(step=3)
    parts = [builder(i, 3)(step=3) for i in range(3)]
    assert whole["q_ids"].shape == (12, 160) and whole["n_ids"].shape == (12, 2, 160)
    for key in whole:
        np.testing.assert_array_equal(whole[key], np.concatenate([p[key] for p in parts]))


def test_rows_keep_records_together_in_order():
    records, _ = synthetic.make_synthetic(0, 12, 2)
    store = _store(records, 8, 8)
    plan = batches.BatchPlan(len(store), 4, seed=0)
    rows = batches.StepTexts(store, plan, 8, 8, texts=_texts(records)).rows(0)
    first = records[plan.record_indices(0)[0]]
    assert rows[:3] == [
        (first["instruction_positive"], first["query_positive"], first["document_positive"]),
        (first["instruction_negative"], first["query_positive"], first["hard_negative_document_1"]),
        (first["instruction_positive"], first["query_negative"], first["hard_negative_document_2"]),
    ]


def test_a_records_rows_are_its_positive_then_its_two_negative_rows():
    """A record's training rows, in order: (I+, Q+, P+), (I-, Q+, P1-), (I+, Q-, P2-); without hard negatives
    only the positive row."""
    record = {"instruction_positive": "I+", "query_positive": "Q+", "document_positive": "P+",
              "instruction_negative": "I-", "query_negative": "Q-", "hard_negative_document_1": "P1-",
              "hard_negative_document_2": "P2-"}
    store = _store([record], 16, 16)
    rows = {hard: batches.StepTexts(store, batches.BatchPlan(1, 1, seed=0), 16, 16, hard,
                                    texts=_texts([record])).rows(0) for hard in (True, False)}
    assert rows[True] == [("I+", "Q+", "P+"), ("I-", "Q+", "P1-"), ("I+", "Q-", "P2-")]
    assert rows[False] == [("I+", "Q+", "P+")]


def test_data_cuts_counts_every_rows_query_and_passage_that_its_max_length_cuts():
    """The run's line at start counts, over every record's three rows (not a sample of steps, and padded or
    packed), the texts whose uncut token count (the tokenizer's own) is over their max length."""
    from infjax.data.tokenize import Tokenizer
    from tests.helpers.tiny import tiny_bert_path

    records, _ = synthetic.make_synthetic(0, 12, 2)
    fmt, tokenizer = TextFormat(), Tokenizer(tiny_bert_path())
    rows = [(r[FIELDS[i]], r[FIELDS[q]], r[FIELDS[p]]) for r in records
            for i, q, p in zip(batches.ROW_INSTRUCTION, batches.ROW_QUERY, batches.ROW_PASSAGE)]
    counted = {}
    for q_len, p_len in ((24, 33), (160, 200)):
        build = batches.BatchBuilder(batches.StepTexts(_store(records, q_len, p_len), batches.BatchPlan(12, 4, seed=0),
                                                       q_len, p_len))
        expected = {"q": np.array(tokenizer.lengths([fmt.query(i, q) for i, q, _ in rows])) > q_len,
                    "p": np.array(tokenizer.lengths([fmt.passage(p) for _, _, p in rows])) > p_len}
        counted[q_len] = build.data_cuts()
        assert counted[q_len] == {side: (int(cut.sum()), len(rows)) for side, cut in expected.items()}
    assert all(0 < cut < 36 for cut, _ in counted[24].values())        # some cut on each side, not all
    assert counted[160] == {"q": (0, 36), "p": (0, 36)}


@pytest.mark.parametrize("packing", [True, False])
def test_real_tokens_of_a_batch_padded_or_packed(packing):
    config = small_config(**{"data.packing": packing})
    encoder, _, path = load_encoder(config.model)
    data = pipeline.open_training_data(config, path, encoder.padding_side)
    build = setup_lib.make_batch_setup(config, data, encoder, path, setup_lib.make_objective(config)).build
    texts, _ = build.step_texts.side_texts(3)
    tokenizer = build.step_texts.texts.tokenizer
    want = sum(len(ids) for side, t in texts.items() for ids in tokenizer.tokens(t, build.max_len(side)))
    batch = build(3)
    padded = sum(v.size for k, v in batch.items() if k.endswith("_mask")) if not packing else \
        sum(v["mask"].size for v in batch.values() if isinstance(v, dict))
    assert batches.real_tokens(batch) == want < padded


def test_text_keys_are_equal_exactly_where_the_texts_are_and_every_process_numbers_alike():
    """loss.mask_duplicates' inputs: rows with the same passage, or the same instruction and query, share a key
    over the global batch; a drawn instruction that reads as the row's own (the same token ids, another
    spelling) is flagged. Checked against the records' texts, for every step, on 1 and 3 processes."""
    records, _ = synthetic.make_synthetic(0, 24, 2)
    for r in (1, 7, 13):                         # passages shared across records
        records[r]["document_positive"] = records[0]["document_positive"]
    records[5]["hard_negative_document_1"] = records[2]["document_positive"]
    records[9]["query_positive"] = records[4]["query_positive"]                  # (I+, Q+) of record 4 again
    records[9]["instruction_positive"] = records[4]["instruction_positive"]
    records[11]["instruction_negative"] = records[3]["instruction_positive"].upper()    # uncased: the same ids
    store = _store(records, 48, 48)
    plan = batches.BatchPlan(len(store), 8, seed=0)
    sampler = batches.InstructionNegativeSampler(len(store.pool), 3, seed=0)
    same = lambda t: " ".join(t.lower().split())    # noqa: E731 - what the uncased tokenizer reads
    seen = {"p": 0, "iq": 0, "n": 0}
    for step in range(plan.steps_per_epoch * 3):
        def keys(pid, count):
            return batches.StepTexts(store, plan, 48, 48, sampler=sampler, process_index=pid, process_count=count,
                                     texts=_texts(records), text_keys=True).text_keys_of(step)
        whole = keys(0, 1)
        for key in whole:
            np.testing.assert_array_equal(whole[key], np.concatenate([keys(i, 3)[key] for i in range(3)]))
        rows = batches.StepTexts(store, plan, 48, 48, texts=_texts(records)).rows(step)
        p = [same(r[2]) for r in rows]
        iq = [(same(r[0]), same(r[1])) for r in rows]
        for a in range(len(rows)):
            for b in range(len(rows)):
                assert (whole["p_text"][a] == whole["p_text"][b]) == (p[a] == p[b])
                assert (whole["iq_text"][a] == whole["iq_text"][b]) == (iq[a] == iq[b])
        seen["p"] += len(rows) - len(set(p))
        seen["iq"] += len(rows) - len(set(iq))
        record, kind, own = batches.StepTexts(store, plan, 48, 48, sampler=sampler)._rows(step)
        pool = [records[int(q) // 7][FIELDS[int(q) % 7]] for q in store.pool]
        drawn = sampler.draw(step, own)
        want = np.array([[same(pool[j]) == iq[r][0] for j in drawn[r]] for r in range(len(rows))])
        np.testing.assert_array_equal(whole["n_same"].astype(bool), want)
        seen["n"] += int(want.sum())
    assert all(seen.values()), seen               # each kind of duplicate met at least once
