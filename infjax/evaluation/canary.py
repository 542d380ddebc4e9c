"""General-retrieval canaries: real text, offline, as retrieval tasks (`lee`, `docstrings`).

Fine-tuning on instruction-following data can quietly erase ordinary topical
retrieval. The canaries measure it on real text that nobody in this project
wrote, read offline from packages on the index.

`lee` reads the test data of gensim (`gensim/test/test_data/`, gensim 4.4.0,
LGPL-2.1):

* `lee.cor`: 50 news articles of the Australian Broadcasting Corporation,
  one per line (latin-1), collected by Lee, Pincombe & Welsh (2005), "An
  empirical evaluation of models of text document similarity", CogSci 2005;
* `similarities0-1.txt`: for every pair of those 50, the mean similarity
  rating of human judges (a 1..5 scale, stored divided by 5; upper triangle);
* `lee_background.cor`: 300 more articles of the same source and period.

As a retrieval task (spec `lee`): each of the 50 articles is a query; the
corpus is the 50 articles plus the 300 background ones (distractors, never
judged relevant); the article itself is left out of its own ranking. The
grade of a pair is its mean human rating, floored, minus one, where that is
>= 1: rating 2..3 -> 1, 3..4 -> 2, 4..5 -> 3, 5 -> 4 ("somewhat" to "the same
story"). Every article has at least one related article at this threshold.
Main metric nDCG@10 (BEIR's metrics beside it). `lee:distractors=N` keeps the
first N background articles (0..300).

The files are checked against their SHA-256 sums, so a `lee` figure always
means the same data.

`docstrings` pairs the one-line summary of each public function and class of
installed libraries (numpy and scipy by default: both BSD-3-Clause, both
installed with JAX) with the description that follows it in the docstring
(the paragraphs before the first numpydoc section, example or directive):
the summary is the query, its description the one relevant passage, every
other description a distractor. Short-query -> passage retrieval in a domain
the training data never touches. Sources are read with `ast` (nothing is
imported); pairs whose summary or description occurs twice are dropped. The
task depends on the installed versions, which its name records, e.g.
`docstrings(numpy 2.4.6, scipy 1.17.1: 600 of 1172)`: compare figures of one
environment. `docstrings:packages=numpy+scipy,limit=600` are the defaults
(`limit=0`: every pair; a limited set is a fixed pseudo-random sample).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import re

from infjax.evaluation.types import BEIR_METRICS, DataError, RetrievalTask, spec_options

FILES = {       # name -> sha256 (gensim 4.4.0)
    "lee.cor": "a878f9a58f6743c32985c56c2f2f75988386216b38a4023a01fd3bcf7884d93e",
    "lee_background.cor": "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
    "similarities0-1.txt": "23762bc6b728897144dda3d324a2c032dc1e059e1009806226d64b6dd123ed79",
}
NUM_ARTICLES, NUM_BACKGROUND = 50, 300


def package_dir(name: str, dataset: str) -> str:
    """The source folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the dataset `{dataset}` reads the installed package {name!r}, which is not installed "
                        f"(pip install {name})")
    return list(spec.submodule_search_locations)[0]


def data_dir() -> str:
    """gensim's test-data folder."""
    return os.path.join(package_dir("gensim", "lee"), "test", "test_data")


def _read(folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read the canary's file ({e.strerror}); reinstall gensim==4.4.0") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != FILES[name]:
        raise DataError(f"{path}: sha256 {digest}, expected {FILES[name]} (gensim 4.4.0's copy); the canary "
                        f"would not be comparable: pip install gensim==4.4.0")
    return raw.decode("latin-1")


def _lines(text: str, path: str, expected: int) -> list[str]:
    lines = [line.strip() for line in text.rstrip("\n").split("\n")]
    if len(lines) != expected or not all(lines):
        raise DataError(f"{path}: expected {expected} non-empty lines, got {len(lines)}")
    return lines


def grade(similarity: float) -> int:
    """The judgment of a pair from its mean human rating / 5: floor(rating) - 1, 0 below rating 2."""
    return max(0, math.floor(5 * similarity + 1e-6) - 1)


def parse_options(options: str) -> int:
    """`distractors=N` (default all 300) -> N."""
    distractors = spec_options("lee", options, {"distractors": NUM_BACKGROUND})["distractors"]
    if not 0 <= distractors <= NUM_BACKGROUND:
        raise DataError(f"--dataset=lee:{options}: distractors must be in [0, {NUM_BACKGROUND}], got {distractors}")
    return distractors


def load_lee(options: str = "") -> RetrievalTask:
    """The canary task (see the module docstring)."""
    distractors = parse_options(options)
    folder = data_dir()
    articles = _lines(_read(folder, "lee.cor"), os.path.join(folder, "lee.cor"), NUM_ARTICLES)
    background = _lines(_read(folder, "lee_background.cor"), os.path.join(folder, "lee_background.cor"),
                        NUM_BACKGROUND)
    sim_path = os.path.join(folder, "similarities0-1.txt")
    rows = _lines(_read(folder, "similarities0-1.txt"), sim_path, NUM_ARTICLES)
    try:
        sim = [[float(v) for v in row.split()] for row in rows]
    except ValueError as e:
        raise DataError(f"{sim_path}: {e}") from None
    if any(len(r) != NUM_ARTICLES for r in sim):
        raise DataError(f"{sim_path}: expected a {NUM_ARTICLES}x{NUM_ARTICLES} matrix")

    ids = [f"lee{i}" for i in range(NUM_ARTICLES)]
    corpus = dict(zip(ids, articles))
    corpus.update({f"bg{i}": text for i, text in enumerate(background[:distractors])})
    qrels = {}
    for i in range(NUM_ARTICLES):
        judged = {ids[j]: grade(sim[min(i, j)][max(i, j)]) for j in range(NUM_ARTICLES) if j != i}
        qrels[ids[i]] = {d: g for d, g in judged.items() if g > 0}
    name = "lee" if distractors == NUM_BACKGROUND else f"lee(distractors={distractors})"
    return RetrievalTask(name, corpus, dict(zip(ids, articles)), dict.fromkeys(ids, ""), qrels,
                         BEIR_METRICS, "ndcg@10", skip_identical_ids=True)


# --------------------------------------------------------------------------
# docstrings
# --------------------------------------------------------------------------

DOCSTRING_PACKAGES = ("numpy", "scipy")
DOCSTRING_LIMIT = 600
_SECTION = re.compile(r"^[A-Z][A-Za-z ]*\n\s*-{3,}")     # a numpydoc heading: "Parameters\n----------"
_STOP = (">>>", "..", "Parameters:", "Returns:", "Args:", "Examples:", "Example:", "Note:", "Notes:")


def summary_and_description(docstring: str) -> tuple[str, str]:
    """(first paragraph, the paragraphs after it up to the first section, example or directive), one line each."""
    paragraphs = [p.strip() for p in docstring.split("\n\n") if p.strip()]
    if not paragraphs:
        return "", ""
    body = []
    for p in paragraphs[1:]:
        if _SECTION.match(p) or p.startswith(_STOP):
            break
        body.append(" ".join(p.split()))
    return " ".join(paragraphs[0].split()), " ".join(body)


def _documented(node: ast.AST, prefix: str):
    """(qualified name, summary, description) of the public functions and classes under `node`."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or child.name.startswith("_"):
            continue
        name = f"{prefix}.{child.name}"
        doc = ast.get_docstring(child)
        if doc:
            summary, description = summary_and_description(doc)
            if len(summary.split()) >= 4 and len(description.split()) >= 20:
                yield name, summary, description
        yield from _documented(child, name)


def docstring_pairs(package: str) -> list[tuple[str, str, str]]:
    """(qualified name, summary, description) of the public functions and classes of `package`'s sources.

    Test folders and private names are skipped; summaries of < 4 words and descriptions of < 20 are too.
    """
    root = package_dir(package, "docstrings")
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("test", "__pycache__", ".")))
        for file in sorted(f for f in files if f.endswith(".py") and not f.startswith("test")):
            path = os.path.join(folder, file)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue             # vendored or generated files that this Python cannot parse
            module = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
            module = module.removesuffix(".__init__")
            out.extend(_documented(tree, module))
    return out


def parse_docstring_options(options: str) -> tuple[tuple[str, ...], int]:
    """`packages=a+b,limit=N` -> ((a, b), N)."""
    d = spec_options("docstrings", options, {"packages": "+".join(DOCSTRING_PACKAGES), "limit": DOCSTRING_LIMIT},
                     forms={"packages": "NAME[+NAME...]"})
    packages = tuple(v for v in d["packages"].split("+") if v)
    if not packages:
        raise DataError(f"--dataset=docstrings:{options}: packages names no package (packages=NAME[+NAME...])")
    if d["limit"] < 0:
        raise DataError(f"--dataset=docstrings:{options}: limit must be >= 0 (0 = every pair)")
    return packages, d["limit"]


def load_docstrings(options: str = "") -> RetrievalTask:
    """The docstring canary (see the module docstring)."""
    packages, limit = parse_docstring_options(options)
    pairs = [p for package in packages for p in docstring_pairs(package)]
    summaries: dict[str, int] = {}
    descriptions: dict[str, int] = {}
    for _, s, d in pairs:
        summaries[s] = summaries.get(s, 0) + 1
        descriptions[d] = descriptions.get(d, 0) + 1
    unique = [p for p in pairs if summaries[p[1]] == 1 and descriptions[p[2]] == 1]
    if not unique:
        raise DataError(f"--dataset=docstrings:{options}: no (summary, description) pair found in {list(packages)}")
    total = len(unique)
    if limit and limit < total:       # a fixed sample: the pairs with the smallest hashes of their names
        unique = sorted(unique, key=lambda p: hashlib.sha256(p[0].encode()).hexdigest())[:limit]
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in packages)
    corpus = {f"d:{name}": description for name, _, description in unique}
    queries = {f"q:{name}": summary for name, summary, _ in unique}
    qrels = {f"q:{name}": {f"d:{name}": 1} for name, _, _ in unique}
    return RetrievalTask(f"docstrings({versions}: {len(unique)} of {total})", corpus, queries,
                         dict.fromkeys(queries, ""), qrels, BEIR_METRICS, "ndcg@10")


# --------------------------------------------------------------------------
# Watching a run
# --------------------------------------------------------------------------


class CanaryWatch:
    """Flags a canary whose main metric fell by more than `margin` since its first evaluation (before
    training) or since its previous one. Pure bookkeeping: the trainer logs and writes what it returns."""

    def __init__(self, margin: float):
        self.margin = margin
        self.first: dict[str, tuple[int, float]] = {}      # spec -> (step, main)
        self.previous: dict[str, tuple[int, float]] = {}

    def update(self, step: int, scores: dict[str, dict[str, float]]) -> list[dict]:
        """Record `scores` ({spec: {"main": ...}}) of `step`; one warning record per canary that dropped."""
        warnings = []
        for spec, metrics in scores.items():
            now = metrics["main"]
            first = self.first.setdefault(spec, (step, now))
            previous = self.previous.get(spec, first)
            if first[1] - now > self.margin or previous[1] - now > self.margin:
                warnings.append({"step": step, "warning": "canary_drop", "set": spec, "main": now,
                                 "first_step": first[0], "first": first[1],
                                 "previous_step": previous[0], "previous": previous[1], "margin": self.margin})
            self.previous[spec] = (step, now)
        return warnings


def describe_drop(w: dict) -> str:
    """The log line of a `CanaryWatch` warning."""
    return (f"canary {w['set']}: main metric {w['main']:.4f} at step {w['step']}, was {w['first']:.4f} at step "
            f"{w['first_step']} and {w['previous']:.4f} at step {w['previous_step']}: a drop of more than "
            f"eval.canary_margin={w['margin']}; general retrieval is being lost "
            f"(a lower train.learning_rate or fewer train.steps usually keeps it)")
