"""Running the stages over a collection: resumable stage files, the InF-IR output files, the report.

Layout of ``--out``::

    run.json                 what the run is (input, selection, models, settings); a rerun must match it
    stages/<stage>.jsonl     one result row per record id, appended and fsync'd chunk by chunk
    cache/                   the response cache (backends.ResponseCache), unless --cache_dir says otherwise
    curated.jsonl, curated.parquet   the kept records: InF-IR fields + provenance columns
    failures.jsonl           every dropped record: stage, kind, category, reason, answers
    report.json              records in, kept, dropped per reason, tokens

A rerun reads the stage files, skips every id that has a result (a row cut short by a kill is discarded),
asks again only for the records whose last result is a backend failure, and writes the outputs (temporary
name, then rename) from the files, in input order: an interrupted run continued gives the same outputs as
an uninterrupted one.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import time

from infjax.curation import prompts
from infjax.curation import stages as stages_lib
from infjax.curation.sources import Collection
from infjax.data.inf_ir import FIELDS
from infjax.errors import RunStopped, UserError
from infjax.runtime import storage

log = logging.getLogger("infjax.curation")

PROVENANCE = ("source_id", "source_passage_id", "generator", "judge", "prompt_version", "prompt_hashes",
              "negatives_source", "judge_answers")


class RunMismatch(UserError, ValueError):
    """--out holds a run made with other settings."""


class StageFile:
    """One stage's append-only result rows (``{"id": ..., ...}`` per line; the last row of an id counts)."""

    def __init__(self, path: str):
        self.path = path
        self.rows: dict[str, dict] = {}
        if os.path.exists(path):
            self._read()

    def _read(self):
        with open(self.path, "rb") as f:
            data = f.read()
        good = 0
        for line in data.split(b"\n")[:-1]:              # a last piece without its newline is a cut row
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            self.rows[row["id"]] = row
            good += len(line) + 1
        if good < len(data):
            log.warning("%s: discarding %d bytes of a row cut short (an interrupted run)", self.path,
                        len(data) - good)
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def append(self, rows: list[dict]) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for row in rows:
            self.rows[row["id"]] = row

    def finished(self, record_id: str) -> bool:
        row = self.rows.get(record_id)
        return row is not None and (row["ok"] or row["kind"] != "backend")


def check_run_identity(out: str, identity: dict, write: bool = True) -> None:
    """On a rerun refuse other settings (they would mix two curations); on the first run write run.json
    (with write=False only check: the caller writes once its input is accepted)."""
    path = os.path.join(out, "run.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            before = json.load(f)
        changed = sorted(k for k in set(before) | set(identity) if before.get(k) != identity.get(k))
        if changed:
            shown = "; ".join(f"{k}: {before.get(k)!r} then, {identity.get(k)!r} now" for k in changed)
            raise RunMismatch(f"{path}: --out holds a curation made with other settings ({shown}); "
                              "use another --out, or the same flags to continue it")
        return
    if write:
        os.makedirs(out, exist_ok=True)
        _write_atomic(path, json.dumps(identity, indent=1, sort_keys=True) + "\n")


def _write_atomic(path: str, text: str | None = None, write=None) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.")
    os.close(fd)
    try:
        if write is not None:
            write(tmp)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
        os.chmod(tmp, 0o666 & ~storage.umask())       # mkstemp makes 0600: outputs get the usual permissions
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def initial_records(collection: Collection) -> list[dict]:
    return [{"id": p.id, "query_positive": p.query, "document_positive": p.passage, "passage_id": p.passage_id}
            for p in collection.pairs]


def run(ctx: stages_lib.Context, out: str, *, run_stages=stages_lib.STAGES, chunk_size: int = 32,
        progress=None) -> dict:
    """Run `run_stages` (in pipeline order) over the collection; write the outputs when verify ran.

    Returns the report. `progress(stage, done, total)` is called after every chunk when given.
    """
    started = time.perf_counter()
    files = {s: StageFile(os.path.join(out, "stages", f"{s}.jsonl")) for s in stages_lib.STAGES}
    records = initial_records(ctx.collection)
    order = {r["id"]: i for i, r in enumerate(records)}
    dropped: dict[str, dict] = {}            # id -> failure row (first stage that dropped it)
    current = records
    for stage in stages_lib.STAGES:
        if stage == "verify":
            current = _clean_all(current, dropped)
        store = files[stage]
        if stage in run_stages:
            todo = [r for r in current if not store.finished(r["id"])]
            if todo:
                log.info("%s: %d of %d records to do", stage, len(todo), len(current))
            for start in range(0, len(todo), chunk_size):
                store.append(stages_lib.RUNNERS[stage](ctx, todo[start:start + chunk_size]))
                if progress:
                    progress(stage, start + len(todo[start:start + chunk_size]), len(todo))
            _check_backend_answered(ctx, stage, [store.rows[r["id"]] for r in todo if r["id"] in store.rows])
        nxt = []
        for r in current:
            row = store.rows.get(r["id"])
            if row is None:
                dropped.setdefault(r["id"], {"id": r["id"], "ok": False, "stage": stage, "kind": "pending",
                                             "category": f"{stage}: not run yet", "reason": "stage not run"})
            elif row["ok"]:
                nxt.append(row)
            else:
                dropped[r["id"]] = row
        current = nxt
    kept = current
    report = make_report(ctx, records, kept, dropped, files, time.perf_counter() - started)
    if "verify" in run_stages:
        write_outputs(out, ctx, kept, sorted(dropped.values(), key=lambda r: order[r["id"]]), report)
    return report


class BackendFailed(RunStopped):
    """Every request of a stage failed at the backend: the run is a failure, not a curation that kept 0."""


def _check_backend_answered(ctx: stages_lib.Context, stage: str, rows: list[dict]) -> None:
    """Stop when a stage ran records and the backend failed every one of them (a closed port, HTTP 500 to
    everything): nothing is written as final, and the stage files keep those records as to-do for a rerun."""
    if not rows or not all(not r["ok"] and r.get("kind") == "backend" for r in rows):
        return
    backend = ctx.judge if stage == "verify" else ctx.generator
    where = getattr(backend, "url", None) or backend.describe()
    raise BackendFailed(f"curation stage {stage!r}: the backend failed every request ({len(rows)} record(s)) at "
                        f"{where}; last error: {rows[-1].get('reason')}. No output was written; rerun when the "
                        f"endpoint answers (finished work in OUT/stages/ is kept)")


def _clean_all(records: list[dict], dropped: dict) -> list[dict]:
    out = []
    for r in records:
        cleaned, reason = stages_lib.clean(r)
        if cleaned is None:
            dropped[r["id"]] = {"id": r["id"], "ok": False, "stage": "clean", "kind": "rejected",
                                "category": "clean: bad row", "reason": reason, "answers": [], "tokens": [0, 0]}
        else:
            out.append(cleaned)
    return out


def output_row(ctx: stages_lib.Context, rec: dict) -> dict:
    hashes = {s: prompts.template_hash(s, ctx.settings.prompt_version) for s in prompts.STAGE_TEMPLATES}
    return {**{f: rec[f] for f in FIELDS},
            "source_id": rec["id"], "source_passage_id": rec["passage_id"],
            "generator": ctx.generator.describe(), "judge": ctx.judge.describe(),
            "prompt_version": ctx.settings.prompt_version, "prompt_hashes": json.dumps(hashes, sort_keys=True),
            "negatives_source": rec["negatives_source"],
            "judge_answers": json.dumps(rec["judge_answers"], sort_keys=True)}


def write_outputs(out: str, ctx: stages_lib.Context, kept: list[dict], dropped: list[dict], report: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [output_row(ctx, r) for r in kept]
    columns = list(FIELDS) + list(PROVENANCE)
    _write_atomic(os.path.join(out, "curated.jsonl"),
                  "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    table = pa.table({c: pa.array([r[c] for r in rows], pa.string()) for c in columns})
    _write_atomic(os.path.join(out, "curated.parquet"), write=lambda tmp: pq.write_table(table, tmp))
    _write_atomic(os.path.join(out, "failures.jsonl"),
                  "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in dropped))
    _write_atomic(os.path.join(out, "report.json"), json.dumps(report, indent=1) + "\n")


def make_report(ctx, records, kept, dropped, files, seconds) -> dict:
    per_reason = collections.Counter(r["category"] for r in dropped.values())
    per_stage_tokens = {}
    for stage, store in files.items():
        rows = [store.rows[r["id"]] for r in records if r["id"] in store.rows]
        per_stage_tokens[stage] = {"prompt_tokens": sum(r.get("tokens", [0, 0])[0] for r in rows),
                                   "completion_tokens": sum(r.get("tokens", [0, 0])[1] for r in rows)}
    totals = {k: sum(t[k] for t in per_stage_tokens.values()) for k in ("prompt_tokens", "completion_tokens")}
    backends = {"generator": ctx.generator.usage.as_dict()}
    if ctx.judge is not ctx.generator:
        backends["judge"] = ctx.judge.usage.as_dict()
    return {"input": ctx.collection.name, "pairs_in_input": ctx.collection.total_pairs, "records_in": len(records),
            "kept": len(kept), "dropped": len(dropped), "dropped_per_reason": dict(sorted(per_reason.items())),
            "tokens": {**totals, "per_stage": per_stage_tokens},
            "this_run": {**backends, "seconds": round(seconds, 2)},
            "generator": ctx.generator.describe(), "judge": ctx.judge.describe(),
            "negatives": ctx.settings.negatives, "prompt_version": ctx.settings.prompt_version}


def format_report(report: dict) -> str:
    lines = [f"records in {report['records_in']} (of {report['pairs_in_input']} pairs in {report['input']}), "
             f"kept {report['kept']}, dropped {report['dropped']}"]
    for reason, n in report["dropped_per_reason"].items():
        lines.append(f"  dropped {n:>5}  {reason}")
    t = report["tokens"]
    lines.append(f"tokens: {t['prompt_tokens']} prompt + {t['completion_tokens']} completion (all answers used)")
    for name, usage in report["this_run"].items():
        if isinstance(usage, dict):
            lines.append(f"this run, {name}: {usage['requests_sent']} requests sent, {usage['cache_hits']} cache "
                         f"hits, {usage['failed_requests']} failed, {usage['retries']} retries, "
                         f"{usage['prompt_tokens']} + {usage['completion_tokens']} tokens")
    lines.append(f"wall time {report['this_run']['seconds']:.1f} s")
    return "\n".join(lines)
