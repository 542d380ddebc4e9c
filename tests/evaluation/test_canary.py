"""The general-retrieval canaries (`lee`, `docstrings`) and the trainer's canary warning."""
import json
import os
import shutil
import textwrap

import numpy as np
import pytest

from infjax.evaluation import canary, datasets
from infjax.evaluation.canary import CanaryWatch
from tests.helpers.configs import small_config


def test_lee_task_matches_the_human_ratings_file():
    task = datasets.load("lee")[0]
    folder = canary.data_dir()
    sim = np.loadtxt(os.path.join(folder, "similarities0-1.txt"))
    assert sim.shape == (50, 50) and np.allclose(np.tril(sim, -1), 0)   # the upper triangle holds the ratings
    ratings = 5 * np.maximum(sim, sim.T)                                 # mean rating on the judges' 1..5 scale
    with open(os.path.join(folder, "lee.cor"), encoding="latin-1") as f:
        articles = f.read().split("\n")
    assert len(task.queries) == 50 and len(task.corpus) == 350
    assert task.skip_identical_ids and task.main_metric == "ndcg@10"
    for i in range(50):
        assert task.queries[f"lee{i}"] == articles[i].strip() == task.corpus[f"lee{i}"]
        expected = {f"lee{j}": int(np.floor(ratings[i, j] + 1e-6)) - 1 for j in range(50)
                    if j != i and ratings[i, j] >= 2 - 1e-6}
        assert task.qrels[f"lee{i}"] == expected and expected, i
    assert task.qrels["lee0"]["lee13"] == 4          # rated 5 by every judge
    assert task.qrels["lee0"]["lee32"] == 3          # mean 4.8
    assert sum(len(v) for v in task.qrels.values()) == 514
    assert not any(d.startswith("bg") for v in task.qrels.values() for d in v)


def test_lee_options_and_errors(tmp_path, monkeypatch):
    assert len(datasets.load("lee:distractors=0")[0].corpus) == 50
    assert datasets.load("lee:distractors=7")[0].name == "lee(distractors=7)"
    for bad, words in (("lee:distractors=301", "[0, 300]"), ("lee:n=3", "distractors=N"),
                       ("lee:distractors=x", "integer")):
        with pytest.raises(datasets.DataError, match=words.replace("[", r"\[")):
            datasets.load(bad)
    # A changed file is refused, naming it (figures would not be comparable).
    copy = tmp_path / "test_data"
    shutil.copytree(canary.data_dir(), copy, ignore=lambda d, names: [n for n in names if n not in canary.FILES])
    with open(copy / "lee.cor", "ab") as f:
        f.write(b" ")
    monkeypatch.setattr(canary, "data_dir", lambda: str(copy))
    with pytest.raises(datasets.DataError, match=r"lee\.cor: sha256 .*gensim==4\.4\.0"):
        datasets.load("lee")


FAKE_PACKAGE = {
    "__init__.py": '''
        def bridge_builder(x):
            """Build a suspension bridge across the widest river.

            Suspension bridges hang their deck from cables slung between towers, so that long spans over deep water
            need no piers in the middle of the stream and ships can pass below without trouble.

            Parameters
            ----------
            x : int
                Ignored words that must not reach the description.
            """

        def _private(x):
            """Private functions are never taken, even with a long enough description.

            This paragraph is long enough to count, with more than twenty words in it, but the name starts with an
            underscore so the function is private.
            """
        ''',
    "kitchen.py": '''
        class Oven:
            """Bake bread loaves in a wood oven.

            A wood-fired oven stores heat in thick masonry walls and releases it slowly, which gives loaves a crisp
            crust and an even crumb when they are baked after the fire has burnt down.

            >>> Oven()
            """

            def preheat(self):
                """Heat the oven before the dough goes in.

                The fire burns for an hour or more until the dome turns white, then the embers are raked out and the
                floor is swept clean before the first loaves go in on a long wooden peel.
                """

        def short():
            """Too short a description here.

            Only a few words.
            """

        def copy_one():
            """The same summary in two functions is ambiguous.

            A query whose summary appears twice has two right answers, so both pairs are dropped from the canary
            task, whatever their descriptions say about anything at all in the world.
            """

        def copy_two():
            """The same summary in two functions is ambiguous.

            This description differs from the first one, but the summary is shared, so neither pair can stay in the
            task as a query with exactly one relevant passage.
            """
        ''',
    "tests/test_things.py": '''
        def test_thing():
            """Tests are skipped when the sources are read.

            Whatever the description says here does not count, because the folder is a test folder and the canary
            reads only library code, never its tests or their fixtures.
            """
        ''',
}


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    root = tmp_path / "site" / "canarypkg"
    for name, text in FAKE_PACKAGE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    (tmp_path / "site" / "canarypkg-1.2.dist-info").mkdir()
    (tmp_path / "site" / "canarypkg-1.2.dist-info" / "METADATA").write_text("Name: canarypkg\nVersion: 1.2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return "canarypkg"


def test_docstring_pairs_from_sources(fake_package):
    pairs = {name: (s, d) for name, s, d in canary.docstring_pairs(fake_package)}
    assert set(pairs) == {"canarypkg.bridge_builder", "canarypkg.kitchen.Oven", "canarypkg.kitchen.Oven.preheat",
                          "canarypkg.kitchen.copy_one", "canarypkg.kitchen.copy_two"}
    summary, description = pairs["canarypkg.bridge_builder"]
    assert summary == "Build a suspension bridge across the widest river."
    assert description.startswith("Suspension bridges hang their deck") and "Ignored" not in description
    assert description.endswith("ships can pass below without trouble.") and "\n" not in description
    assert "Oven()" not in pairs["canarypkg.kitchen.Oven"][1]

    task = datasets.load(f"docstrings:packages={fake_package},limit=0")[0]
    assert task.name == "docstrings(canarypkg 1.2: 3 of 3)"          # the duplicated summary is dropped twice
    assert task.queries == {f"q:{n}": pairs[n][0] for n in
                            ("canarypkg.bridge_builder", "canarypkg.kitchen.Oven", "canarypkg.kitchen.Oven.preheat")}
    assert task.qrels == {q: {"d:" + q[2:]: 1} for q in task.queries}
    assert all(task.corpus["d:" + q[2:]] == pairs[q[2:]][1] for q in task.queries)
    sample = datasets.load(f"docstrings:packages={fake_package},limit=2")[0]
    assert sample.name == "docstrings(canarypkg 1.2: 2 of 3)" and set(sample.queries) < set(task.queries)
    assert datasets.load(f"docstrings:packages={fake_package},limit=2")[0].queries == sample.queries
    for bad, words in (("docstrings:packages=no_such_package_here", "not installed"),
                       ("docstrings:limit=-1", ">= 0"), ("docstrings:size=3", "packages=NAME")):
        with pytest.raises(datasets.DataError, match=words):
            datasets.load(bad)


def test_default_docstrings_task_is_a_fixed_sample():
    task = datasets.load("docstrings")[0]
    assert task.name.startswith("docstrings(numpy ") and ": 600 of " in task.name
    assert len(task.queries) == len(task.corpus) == 600
    assert len(set(task.corpus.values())) == 600 and len(set(task.queries.values())) == 600


def test_watch_flags_drops_since_the_start_and_since_the_last_evaluation():
    watch = CanaryWatch(0.01)
    assert watch.update(0, {"a": {"main": 0.50}, "b": {"main": 0.30}}) == []
    assert watch.update(10, {"a": {"main": 0.495}, "b": {"main": 0.35}}) == []       # within the margin / a rise
    w = watch.update(20, {"a": {"main": 0.488}, "b": {"main": 0.345}})               # a: -0.012 since step 0
    assert [x["set"] for x in w] == ["a"]
    assert w[0] == {"step": 20, "warning": "canary_drop", "set": "a", "main": 0.488, "first_step": 0,
                    "first": 0.50, "previous_step": 10, "previous": 0.495, "margin": 0.01}
    w = watch.update(30, {"a": {"main": 0.49}, "b": {"main": 0.32}})                 # b: -0.025 since step 20
    assert [x["set"] for x in w] == ["a", "b"]                                        # a still below the start
    assert "0.3200 at step 30, was 0.3000 at step 0 and 0.3450 at step 20" in canary.describe_drop(w[1])


@pytest.mark.slow      # end to end (40-120 s here): in CI's slow run, out of the default suite
def test_trainer_evaluates_canaries_and_warns_on_drops(tmp_path, fake_package):
    from infjax import train

    specs = f"lee:distractors=0,docstrings:packages={fake_package}"
    config = small_config(**{"train.steps": 3, "eval.every": 1, "eval.canary": specs, "eval.canary_margin": 0.0,
                             "train.learning_rate": 3e-4, "checkpoint.every": 3, "log_every": 1})
    workdir = str(tmp_path / "run")
    result = train.run(config, workdir)

    with open(os.path.join(workdir, "eval.json")) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(result.eval))
    assert set(saved["before"]["canary"]) == set(saved["after"]["canary"]) == set(specs.split(","))
    assert saved["before"]["step"] == 0 and saved["after"]["step"] == 3
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = {r["step"]: r["eval"] for r in rows if "eval" in r}
    assert sorted(evals) == [1, 2, 3]
    assert {s: evals[3][s] for s in specs.split(",")} == saved["after"]["canary"]

    # The warnings are exactly the drops an independent pass over the recorded scores finds.
    history = {0: saved["before"]["canary"], **evals}
    expected = []
    for spec in specs.split(","):
        first = history[0][spec]["main"]
        for step in (1, 2, 3):
            now, previous = history[step][spec]["main"], history[step - 1][spec]["main"]
            if now < first or now < previous:
                expected.append((step, spec))
    warnings = [(r["step"], r["set"]) for r in rows if r.get("warning") == "canary_drop"]
    assert sorted(warnings) == sorted(expected)
    assert warnings, history          # this run's lee score falls below its start (deterministic run)
