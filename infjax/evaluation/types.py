"""What an evaluation dataset is: the task records every loader returns, and the loaders' error."""
from __future__ import annotations

import dataclasses

from infjax.data.types import FollowIRSplit
from infjax.errors import UserError

BEIR_METRICS = ("ndcg@10", "map@100", "recall@100", "mrr")
FOLLOWIR_METRICS = ("map@1000", "ndcg@5")


class DataError(UserError, ValueError):
    """A dataset that cannot be evaluated; the message names the file, field, line or id."""


def spec_options(kind: str, options: str, defaults: dict, forms: dict[str, str] | None = None) -> dict:
    """The `key=value,...` options of a dataset spec (`kind:options`) over `defaults`.

    A key's value is an integer where its default is one. An unknown key or a non-integer is a DataError naming the
    spec; `forms` shows a text key's value in that message (default "...")."""
    out = dict(defaults)
    for item in filter(None, (s.strip() for s in options.split(","))):
        key, eq, value = item.partition("=")
        if key not in out or not eq:
            wanted = " or ".join(f"{k}=N" if isinstance(v, int) else f"{k}={(forms or {}).get(k, '...')}"
                                 for k, v in defaults.items())
            raise DataError(f"--dataset={kind}:{options}: expected {wanted}, got {item!r}")
        if isinstance(defaults[key], int):
            try:
                value = int(value)
            except ValueError:
                raise DataError(f"--dataset={kind}:{options}: {key} must be an integer, got {value!r}") from None
        out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
    """Retrieve from the whole corpus for each judged query."""

    name: str
    corpus: dict[str, str]                      # doc id -> passage text
    queries: dict[str, str]                     # query id -> query text
    instructions: dict[str, str]                # query id -> instruction ("" when the dataset has none)
    qrels: dict[str, dict[str, int]]            # judged queries only
    metrics: tuple[str, ...] = ("ndcg@10",)
    main_metric: str = "ndcg@10"
    excluded: dict[str, frozenset] = dataclasses.field(default_factory=dict)   # query id -> doc ids never ranked
    skip_identical_ids: bool = False            # BEIR: drop doc id == query id from the ranking
    # judged queries left out: none of their judgments has a grade > 0, so every measure is 0 whatever the
    # ranking (`with_relevant`); they are not in `queries` / `qrels` and not in the means
    without_relevant: tuple[str, ...] = ()
    # judged queries left out: their text is empty, spaces or invisible characters only (`with_text`)
    without_text: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FollowIRTask:
    """Rerank each query's own pool under its original and its changed instruction."""

    name: str
    split: FollowIRSplit
    main_metric: str = "map@1000"
    metrics: tuple[str, ...] = FOLLOWIR_METRICS
    # query id -> judged relevant documents outside its pool (never ranked), for the queries that have any
    relevant_outside_pool: dict[str, int] = dataclasses.field(default_factory=dict)
    # judged queries left out: their text is empty, spaces or invisible characters only (`with_text`)
    without_text: tuple[str, ...] = ()


Task = RetrievalTask | FollowIRTask
