"""The curation stages (paper §4.1, Appendix B), each a function from a chunk of records to result rows.

A record is a dict that grows stage by stage::

    instruct   instruction_positive                      (I+ for (Q+, P+))
    poison     instruction_negative, query_negative      (I-, Q-: subtle alterations that break the match)
    negatives  hard_negative_document_1 (for (I-, Q+)), hard_negative_document_2 (for (I+, Q-)):
               written by the LLM, or retrieved from the collection with an infjax embedder (never P+)
    clean      the InF-IR row rules (infjax.data.inf_ir.clean_record: first line of every instruction and
               query, no empty field)
    verify     the judge sees each tuple's instruction and query with P+, P1-, P2- and k random distractors
               (shuffled) and names the most relevant; kept only if all three tuples pick their own passage

A result row is ``{"id", "ok": true, ...fields}`` or ``{"id", "ok": false, "stage", "kind", "category",
"reason", "answers"}``: ``kind`` is ``malformed`` (the answer broke the format on every attempt),
``backend`` (no answer: HTTP errors, timeouts; a rerun asks again), ``rejected`` (the judge, the cleaning
rules, retrieval without a candidate). Token counts of the answers ride along in ``tokens``.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from infjax.curation import parse, prompts
from infjax.curation.backends import Backend, Request
from infjax.curation.sources import Collection
from infjax.data.inf_ir import BadRowError, clean_record

STAGES = ("instruct", "poison", "negatives", "verify")
NEGATIVES = ("llm", "retrieve")
TUPLES = (("instruction_positive", "query_positive", "document_positive"),
          ("instruction_negative", "query_positive", "hard_negative_document_1"),
          ("instruction_positive", "query_negative", "hard_negative_document_2"))
TUPLE_NAMES = ("(I+,Q+,P+)", "(I-,Q+,P1-)", "(I+,Q-,P2-)")

# Retriever: (instructions, queries) -> for each, passage ids of the collection, best first.
Retriever = Callable[[list[str], list[str]], list[list[str]]]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the stages do; every field that changes an answer is part of the run's identity (run.json)."""

    domain: str = "text"
    negatives: str = "llm"
    distractors: int = 4
    seed: int = 0
    max_attempts: int = 3                # answers per request before a malformed one is recorded as failed
    temperature: float = 0.0
    retry_temperature: float = 0.7       # for attempts after the first when temperature is 0 (greedy repeats)
    max_tokens: int = 256                # instruct, poison, verify answers
    passage_max_tokens: int = 384        # LLM-written negative passages
    prompt_version: str = prompts.VERSION


@dataclasses.dataclass
class Context:
    settings: Settings
    generator: Backend
    judge: Backend
    collection: Collection
    retriever: Retriever | None = None


# Per template: the labels of its answer's lines, and where the answer ends (after one line; after the two
# lines, at a blank line; nowhere: a passage may have paragraphs).
ANSWER_FORMAT = {"instruct": (("INSTRUCTION:",), ("\n",)),
                 "poison": (("NEGATIVE INSTRUCTION:", "NEGATIVE QUERY:"), ("\n\n",)),
                 "negative": (("PASSAGE:",), ()), "verify": (("ANSWER:",), ("\n",))}


def _request(ctx: Context, stage: str, attempt: int, max_tokens: int, **values) -> Request:
    s = ctx.settings
    temperature = s.temperature if attempt == 0 else max(s.temperature, s.retry_temperature)
    messages = prompts.render(stage, domain=s.domain, version=s.prompt_version, **values)
    fields, stop = ANSWER_FORMAT[stage]
    return Request.chat(messages, max_tokens=max_tokens, temperature=temperature, seed=s.seed + attempt,
                        stop=stop, fields=fields)


def _failure(record_id: str, stage: str, kind: str, category: str, reason: str, answers=(), tokens=(0, 0)) -> dict:
    return {"id": record_id, "ok": False, "stage": stage, "kind": kind, "category": category, "reason": reason,
            "answers": list(answers), "tokens": list(tokens)}


def ask(backend: Backend, items: Sequence, build: Callable[[object, int], Request],
        read: Callable[[object, str], object], max_attempts: int) -> list[tuple[object | None, str | None, str, list, tuple]]:
    """Ask one request per item, re-asking those whose answer `read` refuses (parse.Malformed).

    Returns per item ``(value, failure kind or None, reason, answers, (prompt_tokens, completion_tokens))``.
    """
    n = len(items)
    value: list = [None] * n
    kind: list = [None] * n
    reason = [""] * n
    answers: list[list[str]] = [[] for _ in range(n)]
    tokens = [[0, 0] for _ in range(n)]
    pending = list(range(n))
    for attempt in range(max_attempts):
        if not pending:
            break
        answered = backend.complete([build(items[i], attempt) for i in pending])
        retry = []
        for i, completion in zip(pending, answered):
            tokens[i][0] += completion.prompt_tokens
            tokens[i][1] += completion.completion_tokens
            if completion.error is not None:
                kind[i], reason[i] = "backend", completion.error
                continue
            answers[i].append(completion.text)
            try:
                value[i] = read(items[i], completion.text)
            except parse.Malformed as e:
                kind[i], reason[i] = "malformed", f"{e} (after {attempt + 1} answer(s))"
                retry.append(i)
            else:
                kind[i], reason[i] = None, ""
        pending = retry
    return [(value[i], kind[i], reason[i], answers[i], tuple(tokens[i])) for i in range(n)]


def _fold(results, record_ids, stage, ok_fields: Callable[[int, list], dict], per_record: int) -> list[dict]:
    """Rows of records whose `per_record` consecutive results are all answered, else the first failure."""
    rows = []
    for r, record_id in enumerate(record_ids):
        mine = results[r * per_record:(r + 1) * per_record]
        tokens = (sum(t[4][0] for t in mine), sum(t[4][1] for t in mine))
        answers = [a for t in mine for a in t[3]]
        failed = next((t for t in mine if t[1] is not None), None)
        if failed is not None:
            category = f"{stage}: {'backend error' if failed[1] == 'backend' else 'malformed answer'}"
            rows.append(_failure(record_id, stage, failed[1], category, failed[2], answers, tokens))
        else:
            rows.append({"id": record_id, "ok": True, **ok_fields(r, [t[0] for t in mine]), "tokens": list(tokens)})
    return rows


def instruct(ctx: Context, records: list[dict]) -> list[dict]:
    """I+ for each (Q+, P+)."""
    build = lambda rec, k: _request(ctx, "instruct", k, ctx.settings.max_tokens, query=rec["query_positive"],
                                    passage=rec["document_positive"])
    results = ask(ctx.generator, records, build, lambda rec, text: parse.instruction(text), ctx.settings.max_attempts)
    return _fold(results, [r["id"] for r in records], "instruct",
                 lambda r, v: {**records[r], "instruction_positive": v[0]}, 1)


def poison(ctx: Context, records: list[dict]) -> list[dict]:
    """I- and Q- for each record."""
    build = lambda rec, k: _request(ctx, "poison", k, ctx.settings.max_tokens, query=rec["query_positive"],
                                    instruction=rec["instruction_positive"], passage=rec["document_positive"])
    read = lambda rec, text: parse.poison(text, instruction_positive=rec["instruction_positive"],
                                          query_positive=rec["query_positive"], domain=ctx.settings.domain)
    results = ask(ctx.generator, records, build, read, ctx.settings.max_attempts)
    return _fold(results, [r["id"] for r in records], "poison",
                 lambda r, v: {**records[r], "instruction_negative": v[0][0], "query_negative": v[0][1]}, 1)


def negatives(ctx: Context, records: list[dict]) -> list[dict]:
    """P1- for (I-, Q+) and P2- for (I+, Q-): written by the generator, or retrieved."""
    if ctx.settings.negatives == "retrieve":
        return _retrieved_negatives(ctx, records)
    items = [(rec, i_field, q_field) for rec in records
             for i_field, q_field in (("instruction_negative", "query_positive"),
                                      ("instruction_positive", "query_negative"))]
    build = lambda item, k: _request(ctx, "negative", k, ctx.settings.passage_max_tokens,
                                     query=item[0][item[2]], instruction=item[0][item[1]],
                                     passage=item[0]["document_positive"])
    read = lambda item, text: parse.passage(text, avoid=[item[0]["document_positive"]])
    results = ask(ctx.generator, items, build, read, ctx.settings.max_attempts)
    return _fold(results, [r["id"] for r in records], "negatives",
                 lambda r, v: {**records[r], "hard_negative_document_1": v[0], "hard_negative_document_2": v[1],
                               "negatives_source": f"generated:{ctx.generator.describe()}"}, 2)


def _retrieved_negatives(ctx: Context, records: list[dict]) -> list[dict]:
    instructions = [r["instruction_negative"] for r in records] + [r["instruction_positive"] for r in records]
    queries = [r["query_positive"] for r in records] + [r["query_negative"] for r in records]
    ranked = ctx.retriever(instructions, queries)
    passages = ctx.collection.passages
    n, rows = len(records), []
    for r, rec in enumerate(records):
        positive = " ".join(rec["document_positive"].split())
        chosen = []
        for ranking in (ranked[r], ranked[n + r]):
            # never P+ (by id or by text), and P2- differs from P1- when the ranking allows
            usable = [pid for pid in ranking if pid != rec["passage_id"]
                      and " ".join(passages[pid].split()) != positive]
            distinct = [pid for pid in usable if pid not in chosen]
            chosen.append((distinct or usable or [None])[0])
        if None in chosen:
            rows.append(_failure(rec["id"], "negatives", "rejected", "negatives: no retrievable passage",
                                 "every retrieved passage equals P+ (the collection is too small)"))
            continue
        rows.append({"id": rec["id"], "ok": True, **rec, "hard_negative_document_1": passages[chosen[0]],
                     "hard_negative_document_2": passages[chosen[1]], "negative_ids": chosen,
                     "negatives_source": "retrieved", "tokens": [0, 0]})
    return rows


def clean(record: dict) -> tuple[dict | None, str]:
    """The InF-IR row rules on a record: (cleaned record, "") or (None, the reason)."""
    try:
        cleaned = clean_record(record, field_map=None, split="curated", row=0)
    except BadRowError as e:
        return None, f"field {e.field!r}: {e.reason}"
    if " ".join(cleaned["hard_negative_document_1"].split()) == " ".join(cleaned["hard_negative_document_2"].split()):
        return None, "P1- and P2- are the same passage (the judgments would be ambiguous)"
    return {**record, **cleaned}, ""


def _rng(seed: int, record_id: str, salt: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{seed}:{record_id}:{salt}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def candidates(ctx: Context, rec: dict, ids: Sequence[str]) -> tuple[list[str], list[list[int]]]:
    """The verifier's passages for a record: P+, P1-, P2- and k distractors, drawn from the collection with a
    per-record seed; and per tuple the shuffled order (tuple t's own passage is index t of the list)."""
    own = [rec["document_positive"], rec["hard_negative_document_1"], rec["hard_negative_document_2"]]
    norm = {" ".join(p.split()) for p in own}
    rng = _rng(ctx.settings.seed, rec["id"], "distractors")
    distractors = []
    for i in rng.permutation(len(ids)):
        text = ctx.collection.passages[ids[i]]
        if " ".join(text.split()) not in norm:
            distractors.append(text)
            norm.add(" ".join(text.split()))
        if len(distractors) == ctx.settings.distractors:
            break
    passages = own + distractors
    orders = [list(_rng(ctx.settings.seed, rec["id"], f"order{t}").permutation(len(passages))) for t in range(3)]
    return passages, [[int(i) for i in order] for order in orders]


def verify(ctx: Context, records: list[dict]) -> list[dict]:
    """Three judgments per record; kept only if each tuple's own passage is named."""
    ids = sorted(ctx.collection.passages)
    items = []
    for rec in records:
        passages, orders = candidates(ctx, rec, ids)
        for t, (i_field, q_field, _) in enumerate(TUPLES):
            shown = [passages[j] for j in orders[t]]
            items.append((rec, t, shown, orders[t].index(t) + 1))
    build = lambda item, k: _request(ctx, "verify", k, ctx.settings.max_tokens,
                                     instruction=item[0][TUPLES[item[1]][0]], query=item[0][TUPLES[item[1]][1]],
                                     candidates=prompts.candidates_block(item[2]))
    read = lambda item, text: parse.verdict(text, len(item[2]))
    results = ask(ctx.judge, items, build, read, ctx.settings.max_attempts)
    rows = _fold(results, [r["id"] for r in records], "verify",
                 lambda r, v: {**records[r], "judge_answers": [
                     {"tuple": TUPLE_NAMES[t], "picked": v[t], "expected": items[3 * r + t][3],
                      "candidates": len(items[3 * r + t][2])} for t in range(3)]}, 3)
    for row in rows:
        if row["ok"]:
            wrong = [a["tuple"] for a in row["judge_answers"] if a["picked"] != a["expected"]]
            if wrong:
                reason = "the judge named another passage for " + ", ".join(wrong)
                failure = _failure(row["id"], "verify", "rejected", "verify: judge disagreed", reason,
                                   tokens=row["tokens"])
                failure["judge_answers"] = row["judge_answers"]
                row.clear()
                row.update(failure)
    return rows


RUNNERS: dict[str, Callable[[Context, list[dict]], list[dict]]] = {
    "instruct": instruct, "poison": poison, "negatives": negatives, "verify": verify}
