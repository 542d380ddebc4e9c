"""The prompt templates of the curation stages: versioned text files shipped with the package.

``<stage>.<version>.txt`` is the user message of one request, a `string.Template` (``$query``,
``$passage``, ``$instruction``, ``$candidates``, ``$domain_note``). A changed wording is a new version
file; the version and a hash of the text are recorded with every curated record.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import string

VERSION = "v1"
STAGE_TEMPLATES = ("instruct", "poison", "negative", "verify")
DOMAINS = ("text", "code", "math")

# Appendix B.2: for code the instruction names the language and approach, and the poisoned one keeps the
# language; for MetaMath-like data the instruction names the mathematical method.
DOMAIN_NOTES = {
    ("instruct", "code"): "The passage is a code solution: the instruction must name its programming language "
                          "and its solution approach.",
    ("instruct", "math"): "The passage is a worked mathematical solution: the instruction must name the "
                          "mathematical method it uses.",
    ("poison", "code"): "The data is code: the altered instruction must keep the programming language of the "
                        "original instruction and change something else (the approach, a constraint).",
    ("poison", "math"): "The data is mathematics: the altered instruction names another method or constraint.",
    ("negative", "code"): "Write the passage as a code solution in the programming language the instruction "
                          "names.",
}


def template_text(stage: str, version: str = VERSION) -> str:
    if stage not in STAGE_TEMPLATES:
        raise ValueError(f"no prompt template for stage {stage!r}; templates: {list(STAGE_TEMPLATES)}")
    return importlib.resources.files(__package__).joinpath(f"{stage}.{version}.txt").read_text(encoding="utf-8")


def template_hash(stage: str, version: str = VERSION) -> str:
    return hashlib.sha256(template_text(stage, version).encode()).hexdigest()[:12]


def render(stage: str, *, domain: str = "text", version: str = VERSION, **values: str) -> list[dict[str, str]]:
    """The chat messages of one request: the stage's template filled with `values` (every $name required)."""
    if domain not in DOMAINS:
        raise ValueError(f"domain {domain!r} is not one of {list(DOMAINS)}")
    values = {**values, "domain_note": DOMAIN_NOTES.get((stage, domain), "")}
    text = string.Template(template_text(stage, version)).substitute(values)
    return [{"role": "user", "content": text.replace("\n\n\n", "\n\n")}]


def candidates_block(passages: list[str]) -> str:
    """The verifier's numbered candidates: ``[1] text`` blocks separated by blank lines."""
    return "\n\n".join(f"[{i}] {' '.join(p.split())}" for i, p in enumerate(passages, 1))
