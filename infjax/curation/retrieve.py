"""`negatives=retrieve`: hard negatives searched in the source collection with an infjax embedder.

The collection's passages are encoded once (on first use), each (instruction, query) is encoded as the
model's instruction-aware query, and exact search returns the best `top_k` passage ids; the stage takes the
best one that is not P+.
"""
from __future__ import annotations

import numpy as np

from infjax.curation.sources import Collection
from infjax.inference.search import search
from infjax.inference.sources import load_model


class Retriever:
    def __init__(self, model_source: str, collection: Collection, *, top_k: int = 10, batch_size: int = 64):
        self.model = load_model(model_source, batch_size=batch_size, progress=False)
        self.ids = sorted(collection.passages)
        self.texts = [collection.passages[i] for i in self.ids]
        self.top_k = top_k
        self._corpus: np.ndarray | None = None

    def describe(self) -> str:
        return self.model.name

    def __call__(self, instructions: list[str], queries: list[str]) -> list[list[str]]:
        if self._corpus is None:
            self._corpus = self.model.embed_passage([self.model.fmt.passage(t) for t in self.texts])
        embedded = self.model.pair_encoder()(instructions, queries)
        _, indices = search(np.asarray(embedded), self._corpus, self.top_k)
        return [[self.ids[j] for j in row if j >= 0] for row in indices]
