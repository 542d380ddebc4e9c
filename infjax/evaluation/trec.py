"""Evaluation outputs: TREC run files and the --out folder (summary, meta, per-query scores, runs)."""
from __future__ import annotations

import json
import os
import re
import tempfile

from infjax.runtime import storage

Run = dict[str, dict[str, float]]


def write_trec_run(path: str, run: Run, tag: str) -> None:
    """TREC format `qid Q0 docid rank score tag`, ranked by score then doc id (as metrics.ranks)."""
    with storage.replacing(path) as f:
        for q in sorted(run):
            for rank, (d, s) in enumerate(sorted(run[q].items(), key=lambda x: (-x[1], x[0])), 1):
                f.write(f"{q} Q0 {d} {rank} {s:.6f} {tag}\n")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "split"


def write_outputs(out: str, summary: dict, meta: dict, results: list[dict]) -> None:
    """summary.json, meta.json, per_query.json and the TREC runs of `results` (evaluation.tasks) in `out`
    (an object-store URL: written to a local temporary folder, then uploaded)."""
    if storage.is_remote(out):
        with tempfile.TemporaryDirectory(prefix="infjax-eval-out-") as tmp:
            write_outputs(tmp, summary, meta, results)
            storage.copy_tree(tmp, out)
        return
    os.makedirs(out, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise PermissionError(f"--out={out} is not writable")
    with storage.replacing(os.path.join(out, "summary.json")) as f:
        json.dump(summary, f, indent=2)
    with storage.replacing(os.path.join(out, "meta.json")) as f:
        json.dump(meta, f, indent=2)
    several = len(results) > 1
    per_query = {r["name"]: r["per_query"] for r in results} if several else results[0]["per_query"]
    with storage.replacing(os.path.join(out, "per_query.json")) as f:
        json.dump(per_query, f, indent=1, sort_keys=True)
    tag = _slug(os.path.basename(os.path.normpath(meta["model"])))[-40:] or "infjax"
    for r in results:
        for label, run in r["runs"].items():
            parts = ["run"] + ([_slug(r["name"])] if several else []) + ([label] if label else []) + ["trec"]
            write_trec_run(os.path.join(out, ".".join(parts)), run, tag)
