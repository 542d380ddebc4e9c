"""An infjax model behind MTEB's encoder interface, and infjax's FollowIR-style splits as MTEB tasks.

mteb itself stays an optional, lazily imported package: `pip install -e ".[mteb]"`, mteb 2.x. Usage:

    import mteb
    from infjax.evaluation.mteb_adapter import InfjaxMTEBModel, mteb_task
    from infjax.evaluation import datasets

    model = InfjaxMTEBModel("runs/x")                      # a run directory (latest step), or step=N
    # model = InfjaxMTEBModel("intfloat/e5-base-v2", query_prefix="query: ", passage_prefix="passage: ")
    tasks = mteb.get_tasks(tasks=["Robust04InstructionRetrieval", "News21InstructionRetrieval",
                                  "Core17InstructionRetrieval"])          # from the hub
    tasks = [mteb_task(t) for t in datasets.load("followir:/data/core17-instructions")]   # or local data
    mteb.evaluate(model, tasks, cache=None)

What MTEB passes, and what the adapter does with it:

* `encode(inputs, *, task_metadata, hf_split, hf_subset, prompt_type)` (mteb 2.x's EncoderProtocol):
  `inputs` is a DataLoader of dict batches. Query batches carry `query` and `instruction` columns (and
  `text`, MTEB's own `"{query} {instruction}"`): the pair goes through the model's own interaction, i.e.
  `template(instruction, query)` plus the query prefix (Interaction I) or the pair encoder (Interaction
  II), so a model trained with another template still gets its own text. Without an `instruction`
  column, `query` (else `text`) is the query text. Document batches: `text`, which MTEB builds as
  `title + " " + body` (infjax's convention too), with the passage prefix.
* `encode(sentences, *, prompt_type="query"|"passage", instruction=...)` (mteb 1.x): lists of strings;
  a query's instruction is formatted as above; corpus entries may be `{"title", "text"}` dicts.
  Without a prompt type, texts are encoded as passages (symmetric tasks: STS, clustering, classification).
* `encode_queries` / `encode_corpus` (older retrieval evaluators).
* `similarity` / `similarity_pairwise`: MTEB's own cosine functions; `mteb_model_meta`: a ModelMeta named
  `infjax/<source>` (revision: the run's step), cosine similarity, the embedding size.

Embeddings are L2-normalized float32 numpy arrays.

`mteb_task(FollowIRTask)` is an MTEB instruction-reranking task (the type of MTEB's FollowIR tasks) over
infjax's split: query ids `<id>-og` / `<id>-changed` with their instructions, each query's candidate pool
as MTEB's `top_ranked`, the qrels under both instructions, and the documents whose relevance differs as
MTEB's `changed_qrels`, scored by MTEB's own FollowIR scorer (p-MRR as a fraction: infjax reports it x100;
MAP@1000 / nDCG@5 of the original instruction under `og`, rounded to 5 decimals as MTEB does, and the
same means unrounded under `og_unrounded`).
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import numpy as np

from infjax.evaluation import metrics
from infjax.evaluation.types import DataError, FollowIRTask
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
        self._meta = None

    @property
    def mteb_model_meta(self):
        """MTEB's ModelMeta for this model (built on first use; mteb is imported then)."""
        if self._meta is None:
            from mteb.models.model_meta import ModelMeta

            base = os.path.basename(os.path.normpath(self.model.name)) or "model"
            self._meta = ModelMeta.create_empty(overwrites={
                "name": f"infjax/{base}",
                "revision": f"step-{self.model.step}" if self.model.step is not None else "no_revision_available",
                "similarity_fn_name": "cosine",
                "embed_dim": int(self.model.embed_passage(["x"]).shape[1]),
                "max_tokens": max(self.model.query_max_len, self.model.passage_max_len),
                "use_instructions": True,
            })
        return self._meta

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
    def encode(self, inputs, *, prompt_type=None, instruction: str | None = None, **kwargs) -> np.ndarray:
        """mteb 2.x: a DataLoader of dict batches (task_metadata, hf_split, hf_subset are not needed);
        mteb 1.x: a list of strings (or one string)."""
        kind = _prompt_kind(prompt_type)
        if not isinstance(inputs, (list, tuple, str)) and hasattr(inputs, "__iter__"):
            return self._encode_batches(inputs, kind)
        sentences = [inputs] if isinstance(inputs, str) else list(inputs)
        if kind == "query":
            return self._embed_queries(sentences, None if instruction is None else [instruction] * len(sentences))
        return self.model.embed_passage(self._passages(sentences))

    def _encode_batches(self, batches, kind: str | None) -> np.ndarray:
        """mteb 2.x: a DataLoader of dict batches."""
        out = []
        for batch in batches:
            if kind == "query":
                queries = batch["query"] if "query" in batch else batch["text"]
                out.append(self._embed_queries(queries, batch.get("instruction")))
            else:
                out.append(self.model.embed_passage([self.model.fmt.passage(t) for t in batch["text"]]))
        if not out:
            raise ValueError("MTEB passed no input to encode")
        return np.concatenate(out)

    def similarity(self, embeddings1, embeddings2):
        from mteb.similarity_functions import cos_sim

        return cos_sim(embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2):
        from mteb.similarity_functions import pairwise_cos_sim

        return pairwise_cos_sim(embeddings1, embeddings2)

    def encode_queries(self, queries: list[str], **kwargs) -> np.ndarray:
        return self._embed_queries(queries, None)

    def encode_corpus(self, corpus, **kwargs) -> np.ndarray:
        if isinstance(corpus, dict):              # {"title": [...], "text": [...]}
            corpus = [{"title": t, "text": x} for t, x in zip(corpus.get("title") or [""] * len(corpus["text"]),
                                                              corpus["text"])]
        return self.model.embed_passage(self._passages(corpus))


def changed_documents(task: FollowIRTask) -> dict[str, list[str]]:
    """Query id -> the documents whose relevance differs between the original and the changed qrels
    (what MTEB's FollowIR data calls `qrel_diff`; infjax's p-MRR runs over the same documents)."""
    s = task.split
    return {q: metrics.changed_documents(s.qrels_og.get(q, {}), s.qrels_changed.get(q, {})) for q in s.queries}


def mteb_task(task: FollowIRTask):
    """An MTEB 2.x instruction-reranking task holding `task`'s split (see the module docstring).

    MTEB leaves out a query without a relevant document and then skips it in p-MRR with only a log line;
    such a split is refused here, naming the queries, so that both sides score the same queries."""
    from datasets import Dataset
    # MTEB's own FollowIR tasks score with this function; it is not exported elsewhere in mteb 2.x.
    from mteb._evaluators.retrieval_metrics import evaluate_p_mrr_change
    from mteb.abstasks import AbsTaskRetrieval
    from mteb.abstasks.task_metadata import TaskMetadata

    if not isinstance(task, FollowIRTask):
        raise DataError(f"{task.name}: mteb_task takes a FollowIR-style task (followir:, synthetic), "
                        f"not a {type(task).__name__}")
    s = task.split
    empty = [f"{q} ({which})" for q in s.queries for which, qrels in (("original", s.qrels_og),
                                                                       ("changed", s.qrels_changed))
             if not any(g > 0 for g in qrels.get(q, {}).values())]
    if empty:
        raise DataError(f"{task.name}: query id(s) {empty[:5]} have no relevant document; MTEB would leave "
                        f"them out of its scores")
    changed = changed_documents(task)
    queries, relevant, top_ranked = [], {}, {}
    for q in s.queries:
        for suffix, instructions, qrels in (("og", s.instructions_og, s.qrels_og),
                                            ("changed", s.instructions_changed, s.qrels_changed)):
            qid = f"{q}-{suffix}"
            queries.append({"id": qid, "text": s.queries[q], "instruction": instructions[q]})
            relevant[qid] = {d: int(g) for d, g in qrels.get(q, {}).items()}
            top_ranked[qid] = list(s.candidates[q])
    data = {"corpus": Dataset.from_list([{"id": d, "title": "", "text": t} for d, t in s.corpus.items()]),
            "queries": Dataset.from_list(queries), "relevant_docs": relevant, "top_ranked": top_ranked}

    class InfjaxFollowIRTask(AbsTaskRetrieval):
        metadata = TaskMetadata(
            name="infjax:" + task.name,
            description=f"infjax's FollowIR-style split {task.name}, read by infjax.evaluation.datasets.",
            reference=None,
            dataset={"path": "infjax/local", "revision": "local"},
            type="InstructionReranking",
            category="t2t",
            modalities=["text"],
            eval_splits=["test"],
            eval_langs=["eng-Latn"],
            main_score="p-MRR",
            date=None,
            domains=None,
            task_subtypes=None,
            license=None,
            annotations_creators=None,
            dialect=None,
            sample_creation=None,
            bibtex_citation="",
        )

        def load_data(self, num_proc=None, **kwargs) -> None:
            self.dataset = {"default": {"test": dict(data)}}
            self.data_loaded = True

        def task_specific_scores(self, scores, qrels, results, hf_split, hf_subset) -> dict:
            out = dict(evaluate_p_mrr_change(qrels, results, changed, self.k_values))
            # MTEB rounds its means to 5 decimals; the same means of its own per-query pytrec_eval values, unrounded.
            og = [v for q, v in scores.items() if q.endswith("-og")]
            out["og_unrounded"] = {f"{name}_at_{k}": float(np.mean([v[f"{measure}_{k}"] for v in og]))
                                   for name, measure in (("map", "map_cut"), ("ndcg", "ndcg_cut"))
                                   for k in self.k_values}
            return out

    return InfjaxFollowIRTask()
