"""`negatives=retrieve`: hard negatives searched in the source collection with an infjax embedder.

The embedder is encoded by infjax's own encoder: a run, a Hugging Face folder, and a sentence-transformers folder
that infjax reads as sentence-transformers does (an infjax export); sentence-transformers encodes only the
folders infjax cannot (another module, pooling or family), saying why.

The collection's passages are encoded once (on first use), CHUNK passages at a time, each chunk's
embeddings appended to an index file (`RowFile`, in the output folder or a temporary folder, removed when
the run ends); each (instruction, query) is encoded as the model's instruction-aware query, and exact search
reads the index a block at a time and returns the best `top_k` passage ids; the stage takes the best one that
is not P+. The host holds one chunk of passages' tokens and one block of embeddings, not the collection's: the
collection's texts are all that grows with it (`--limit` selects pairs, never passages).
"""
from __future__ import annotations

import logging
import sys
import tempfile
import time

import numpy as np

from infjax.curation.sources import Collection
from infjax.inference.search import RowFile, search
from infjax.inference.sources import load_model

log = logging.getLogger("infjax.curate")

CHUNK = 65536                 # passages encoded per call of the embedder (its own chunks are smaller)
BLOCK_BYTES = 64 << 20        # index rows read per search block: this many bytes of float32 embeddings


class Retriever:
    def __init__(self, model_source: str, collection: Collection, *, top_k: int = 10, batch_size: int = 64,
                 index_dir: str | None = None, chunk: int = CHUNK, progress: bool | None = None):
        # infjax's encoder wherever it reads the folder as sentence-transformers does (an infjax export): the same
        # embeddings, several times faster than sentence-transformers on torch
        self.model = load_model(model_source, batch_size=batch_size, progress=False, prefer_infjax=True)
        self.collection = collection
        self.ids = sorted(collection.passages)
        self.top_k, self.chunk, self.index_dir = top_k, chunk, index_dir
        self.progress = sys.stderr.isatty() if progress is None else progress
        self._index: RowFile | None = None
        self._folder: tempfile.TemporaryDirectory | None = None

    def describe(self) -> str:
        return self.model.name

    def index(self) -> RowFile:
        """The collection's embeddings, encoded on first use, chunk by chunk, into a file."""
        if self._index is not None:
            return self._index
        self._folder = tempfile.TemporaryDirectory(prefix="retrieve-index-", dir=self.index_dir)
        n, t0 = len(self.ids), time.perf_counter()
        log.info("negatives=retrieve: encoding the collection's %d passages with %s, %d at a time, into an index "
                 "file (once per run)", n, self.model.name, self.chunk)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, desc="encoding the collection", unit="passage", dynamic_ncols=True, leave=False)
        rows = None
        for lo in range(0, n, self.chunk):
            part = self.ids[lo:lo + self.chunk]
            emb = np.asarray(self.model.embed_passage([self.model.fmt.passage(self.collection.passages[i])
                                                       for i in part]), np.float32)
            if rows is None:
                rows = RowFile(f"{self._folder.name}/passages.f32", emb.shape[1])
            rows.append(emb)
            if bar is not None:
                bar.update(len(part))
            elif lo + len(part) < n:
                log.info("negatives=retrieve: %d / %d passages encoded (%.0f s)", lo + len(part), n,
                         time.perf_counter() - t0)
        if bar is not None:
            bar.close()
        log.info("negatives=retrieve: %d passages encoded in %.0f s (index %.0f MB)", n, time.perf_counter() - t0,
                 rows.nbytes / 1e6)
        self._index = rows
        return rows

    def __call__(self, instructions: list[str], queries: list[str]) -> list[list[str]]:
        corpus = self.index()
        embedded = np.asarray(self.model.pair_encoder()(instructions, queries))
        block = max(1, BLOCK_BYTES // (4 * corpus.shape[1]))
        _, indices = search(embedded, corpus, self.top_k, block_size=block)
        return [[self.ids[j] for j in row if j >= 0] for row in indices]
