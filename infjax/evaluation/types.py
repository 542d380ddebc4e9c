"""What an evaluation dataset is: the task records every loader returns, and the loaders' error."""
from __future__ import annotations

import dataclasses

from infjax.data.types import FollowIRSplit
from infjax.errors import UserError

BEIR_METRICS = ("ndcg@10", "map@100", "recall@100", "mrr")
FOLLOWIR_METRICS = ("map@1000", "ndcg@5")


class DataError(UserError, ValueError):
    """A dataset that cannot be evaluated; the message names the file, field, line or id."""


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


@dataclasses.dataclass(frozen=True)
class FollowIRTask:
    """Rerank each query's own pool under its original and its changed instruction."""

    name: str
    split: FollowIRSplit
    main_metric: str = "map@1000"
    metrics: tuple[str, ...] = FOLLOWIR_METRICS


Task = RetrievalTask | FollowIRTask
