"""An infjax model behind MTEB's encoder interface (mteb itself stays an optional, lazily used package).

    pip install mteb
    python - <<'EOF'
    import mteb
    from infjax.evaluation.mteb_adapter import InfjaxMTEBModel

    model = InfjaxMTEBModel("runs/x")                      # a run directory (latest step), or step=N
    # model = InfjaxMTEBModel("intfloat/e5-base-v2", query_prefix="query: ", passage_prefix="passage: ")
    tasks = mteb.get_tasks(tasks=["Robust04InstructionRetrieval", "News21InstructionRetrieval",
                                  "Core17InstructionRetrieval"])
    mteb.evaluate(model, tasks)                            # mteb >= 2; older: mteb.MTEB(tasks=tasks).run(model)
    EOF

What MTEB passes, and what the adapter does with it:

* `encode(sentences: list[str], *, prompt_type="query"|"passage", instruction=..., task_name=...)`
  (mteb 1.x): queries are formatted with the model's TextFormat as
  `template(instruction, query)` plus the query prefix; when MTEB has already
  appended the instruction to the query text (its FollowIR tasks do, as
  `"{query} {instruction}"`), no instruction is passed and the text is used
  as is. Runs trained with Interaction II (cross-attention) encode the
  (instruction, query) pair apart instead of one text. Passages get the
  passage prefix. Without a prompt type, texts are
  encoded as passages (symmetric tasks: STS, clustering, classification).
* `encode(dataloader, *, task_metadata, hf_split, hf_subset, prompt_type)` (mteb 2.x):
  batches are dicts; `query` + `instruction` columns are formatted as above,
  `title` + `body`/`text` columns become passages, else `text` is used.
* `encode_queries(queries)` / `encode_corpus(corpus)` (older retrieval
  evaluators): corpus entries may be `{"title", "text"}` dicts.

Embeddings are L2-normalized float32 numpy arrays; MTEB's cosine and dot
similarities then agree.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from infjax.inference.sources import EmbeddingModel, load_model


def _prompt_kind(prompt_type) -> str | None:
    """'query' | 'passage' | None from MTEB's PromptType enum (or its string value)."""
    if prompt_type is None:
        return None
    value = getattr(prompt_type, "value", prompt_type)
    return "query" if str(value).lower() in ("query", "queries") else "passage"


def _passage_text(item: Any) -> str:
    if isinstance(item, dict):
        title = item.get("title") or ""
        body = item.get("text") or item.get("body") or ""
        return f"{title} {body}".strip()
    return str(item)


class InfjaxMTEBModel:
    """MTEB encoder over an infjax model: `InfjaxMTEBModel(source, **load_model kwargs)` or an EmbeddingModel."""

    def __init__(self, model: str | EmbeddingModel, **kwargs):
        self.model = model if isinstance(model, EmbeddingModel) else load_model(model, **kwargs)
        self.mteb_model_meta = None            # mteb fills in a default ModelMeta when it is None

    # -- formatting -------------------------------------------------------
    def _embed_queries(self, queries: Iterable[str], instructions: Iterable[str] | None) -> np.ndarray:
        """Queries with their instructions through the model's interaction; without, the text as is (+ prefix)."""
        queries = [str(q) for q in queries]
        if instructions is None:
            if self.model.embed_pairs is not None:       # Interaction II always needs the pair: an empty instruction
                return self.model.embed_pairs([""] * len(queries), queries)
            return self.model.embed_query([self.model.fmt.query_prefix + q for q in queries])
        return self.model.pair_encoder()([i or "" for i in instructions], queries)

    def _passages(self, items: Iterable[Any]) -> list[str]:
        return [self.model.fmt.passage(_passage_text(x)) for x in items]

    # -- MTEB entry points ------------------------------------------------
    def encode(self, sentences, *, prompt_type=None, instruction: str | None = None, **kwargs) -> np.ndarray:
        kind = _prompt_kind(prompt_type)
        if not isinstance(sentences, (list, tuple)) and hasattr(sentences, "__iter__") \
                and not isinstance(sentences, str):
            return self._encode_batches(sentences, kind)
        sentences = [sentences] if isinstance(sentences, str) else list(sentences)
        if kind == "query":
            return self._embed_queries(sentences, None if instruction is None else [instruction] * len(sentences))
        return self.model.embed_passage(self._passages(sentences))

    def _encode_batches(self, batches, kind: str | None) -> np.ndarray:
        """mteb 2.x: a DataLoader of dict batches."""
        if kind == "query":
            out = [self._embed_queries(b["query"] if "query" in b else b["text"], b.get("instruction"))
                   for b in batches]
            return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
        texts: list[str] = []
        for batch in batches:
            if "title" in batch or "body" in batch:
                bodies = batch.get("body") or batch.get("text")
                titles = batch.get("title") or [""] * len(bodies)
                texts += self._passages({"title": t, "text": b} for t, b in zip(titles, bodies))
            else:
                texts += self._passages(batch["text"])
        return self.model.embed_passage(texts) if texts else np.zeros((0, 0), np.float32)

    def encode_queries(self, queries: list[str], **kwargs) -> np.ndarray:
        return self._embed_queries(queries, None)

    def encode_corpus(self, corpus, **kwargs) -> np.ndarray:
        if isinstance(corpus, dict):              # {"title": [...], "text": [...]}
            corpus = [{"title": t, "text": x} for t, x in zip(corpus.get("title") or [""] * len(corpus["text"]),
                                                              corpus["text"])]
        return self.model.embed_passage(self._passages(corpus))
