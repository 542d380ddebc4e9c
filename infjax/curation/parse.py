"""Strict parsing of each stage's answer format (the formats the templates in prompts/ ask for).

A parser returns the value or raises `Malformed` with the reason; the stage retries the request, then
records the record as failed with that reason. Nothing is repaired or guessed: a label that is missing,
repeated or followed by nothing or by the format's placeholder ("<the instruction>"), extra prose, an out-of-range number, a negative identical to its positive,
or (code data) a poisoned instruction in another programming language is malformed. So is a value that is no
usable training text: bytes that were not UTF-8 (decoded as U+FFFD), terminal escapes or other control
characters, or no letter or digit at all.
"""
from __future__ import annotations

import re
import unicodedata

from infjax.data.inf_ir import normal_text


class Malformed(ValueError):
    """An answer that does not follow its stage's format; the message is the reason."""


# Programming languages an instruction may name (Appendix B.2: I- keeps the language of I+).
LANGUAGES = ("python", "java", "javascript", "typescript", "c++", "c#", "c", "go", "golang", "rust", "ruby",
             "kotlin", "swift", "scala", "php", "sql", "haskell", "r", "perl", "bash", "matlab")
_LANGUAGE_RE = re.compile(r"(?<![\w+#])(" + "|".join(re.escape(x) for x in sorted(LANGUAGES, key=len, reverse=True))
                          + r")(?![\w+#])", re.IGNORECASE)
_SINGLE_LETTER = {"c", "r"}          # counted only when written as a capital (a "c" inside prose is no language)


# A value that only echoes the format's placeholder: "<the instruction>", "[the altered query]".
_PLACEHOLDER = re.compile(r"<[^<>]*>|\[[^\[\]]*[^\[\]\d\s][^\[\]]*\]")


def _unusable(value: str) -> str:
    """Why `value` is no usable training text ("" when it is)."""
    if "\ufffd" in value:
        return "holds bytes that are not UTF-8 (decoded as U+FFFD)"
    control = sorted({c for c in value if unicodedata.category(c) == "Cc" and c not in "\t\n\r"})
    if control:
        shown = ", ".join(repr(c)[1:-1] for c in control[:3])
        return f"holds terminal escapes or control characters ({shown})"
    if not any(c.isalnum() for c in value):
        return "holds no letter or digit"
    return ""


def _checked(label: str, value: str) -> str:
    problem = _unusable(value)
    if problem:
        raise Malformed(f"'{label}:' {problem}: not usable training text")
    return value


def _lines(answer: str) -> list[str]:
    return [line.strip() for line in answer.strip().splitlines() if line.strip()]


def _labelled(lines: list[str], labels: tuple[str, ...]) -> list[str]:
    """The values of `labels`, one line each, in order, and no other line."""
    if len(lines) != len(labels):
        shown = " / ".join(f"'{label}: ...'" for label in labels)
        raise Malformed(f"expected {len(labels)} line(s) ({shown}), got {len(lines)}")
    values = []
    for line, label in zip(lines, labels):
        head, sep, value = line.partition(":")
        if not sep or head.strip().upper() != label:
            raise Malformed(f"expected a line starting with '{label}:', got {line[:60]!r}")
        value = value.strip()
        if not value:
            raise Malformed(f"'{label}:' is followed by nothing")
        if _PLACEHOLDER.fullmatch(value):
            raise Malformed(f"'{label}:' is followed by a placeholder, {value[:40]!r}, not an answer")
        values.append(_checked(label, value))
    return values


def languages(text: str) -> set[str]:
    """Programming languages named in `text` (lower case; golang counts as go)."""
    found = set()
    for m in _LANGUAGE_RE.finditer(text):
        word = m.group(1)
        if word.lower() in _SINGLE_LETTER and word != word.upper():
            continue
        found.add("go" if word.lower() == "golang" else word.lower())
    return found


def instruction(answer: str) -> str:
    """``INSTRUCTION: <text>`` -> text."""
    return _labelled(_lines(answer), ("INSTRUCTION",))[0]


def poison(answer: str, *, instruction_positive: str, query_positive: str, domain: str = "text") -> tuple[str, str]:
    """``NEGATIVE INSTRUCTION: ...`` / ``NEGATIVE QUERY: ...`` -> (I-, Q-), each different from its positive."""
    neg_i, neg_q = _labelled(_lines(answer), ("NEGATIVE INSTRUCTION", "NEGATIVE QUERY"))
    if normal_text(neg_i) == normal_text(instruction_positive):
        raise Malformed("the negative instruction repeats the positive one")
    if normal_text(neg_q) == normal_text(query_positive):
        raise Malformed("the negative query repeats the positive one")
    if domain == "code":
        pos, neg = languages(instruction_positive), languages(neg_i)
        if pos and neg != pos:
            raise Malformed(f"the negative instruction names the language(s) {sorted(neg)}, the positive one "
                            f"{sorted(pos)} (code data keeps the language, Appendix B.2)")
    return neg_i, neg_q


def passage(answer: str, *, avoid: list[str]) -> str:
    """``PASSAGE: <text, any number of lines>`` -> text, different from every passage in `avoid`."""
    text = answer.strip()
    head, sep, value = text.partition(":")
    if not sep or head.strip().upper() != "PASSAGE":
        raise Malformed(f"expected the answer to start with 'PASSAGE:', got {text[:60]!r}")
    value = value.strip()
    if not value:
        raise Malformed("'PASSAGE:' is followed by nothing")
    _checked("PASSAGE", value)
    if any(normal_text(value) == normal_text(a) for a in avoid):
        raise Malformed("the generated passage repeats the positive passage")
    return value


def verdict(answer: str, candidates: int) -> int:
    """``ANSWER: <n>`` -> n (1-based, at most `candidates`)."""
    value = _labelled(_lines(answer), ("ANSWER",))[0].strip("[]. ")
    if not value.isdigit():
        raise Malformed(f"'ANSWER:' must be followed by a passage number, got {value[:30]!r}")
    n = int(value)
    if not 1 <= n <= candidates:
        raise Malformed(f"passage number {n} is not one of 1..{candidates}")
    return n
