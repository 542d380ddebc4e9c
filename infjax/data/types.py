"""Data types shared by the data layer and evaluation."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FollowIRSplit:
    """A FollowIR-style evaluation split.

    Each query's own candidate pool is reranked under its original and its changed instruction."""

    corpus: dict[str, str]                       # doc id -> passage
    queries: dict[str, str]                      # query id -> query text
    instructions_og: dict[str, str]              # query id -> original instruction
    instructions_changed: dict[str, str]         # query id -> changed (stricter) instruction
    candidates: dict[str, list[str]]             # query id -> candidate doc ids
    qrels_og: dict[str, dict[str, int]]          # relevance under the original instruction
    qrels_changed: dict[str, dict[str, int]]     # relevance under the changed instruction
