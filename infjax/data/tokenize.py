"""Text formatting (query template, prefixes) and fixed-shape tokenization."""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class TextFormat:
    """How an (instruction, query) pair and a passage become encoder input text (docs/method.md §1.4)."""

    query_template: str = "{query} {instruction}"
    query_prefix: str = ""
    passage_prefix: str = ""

    def __post_init__(self):
        validate_template(self.query_template)

    def query(self, instruction: str, query: str) -> str:
        return self.query_prefix + self.query_template.format(instruction=instruction, query=query).strip()

    def passage(self, text: str) -> str:
        return self.passage_prefix + text

    def alone(self, text: str) -> str:
        """An instruction or a query encoded on its own (Interaction II)."""
        return self.query_prefix + text


def validate_template(template: str, key: str = "data.query_template") -> None:
    """The template must name {query} and {instruction} and nothing else."""
    import string

    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"{key}={template!r} is not a valid format string: {e}") from None
    if names != {"query", "instruction"}:
        raise ValueError(f"{key}={template!r} must contain exactly the fields {{query}} and {{instruction}}, "
                         f"found {sorted(names)}")


# Texts tokenized in one call of the Hugging Face tokenizer at most (`Tokenizer.tokens`, `lengths`, `token_keys`):
# its encodings hold each token's string and offsets besides the ids, tens of times the ids' memory.
CHUNK = 4096


class Tokenizer:
    """A Hugging Face tokenizer that always returns [N, max_len] int32 ids and mask."""

    def __init__(self, path: str, padding_side: str = "right"):
        from transformers import AutoTokenizer

        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path)
        self._tok.padding_side = padding_side
        if self._tok.pad_token is None:
            self._tok.pad_token = self._tok.eos_token

    def __call__(self, texts: list[str], max_len: int) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros((0, max_len), np.int32), np.zeros((0, max_len), np.int32)
        out = self._tok(list(texts), padding="max_length", truncation=True, max_length=max_len,
                        return_tensors="np")
        return out["input_ids"].astype(np.int32), out["attention_mask"].astype(np.int32)

    @property
    def pad_id(self) -> int:
        return int(self._tok.pad_token_id)

    def _ids(self, texts: list[str], **kwargs):
        """The tokenizer's input_ids of `texts`, CHUNK texts at a time: its per-text encodings (tokens, offsets,
        masks) of one chunk at most are alive at once, whatever the number of texts."""
        for start in range(0, len(texts), CHUNK):
            yield from self._tok(list(texts[start:start + CHUNK]), **kwargs)["input_ids"]

    def tokens(self, texts: list[str], max_len: int) -> list[np.ndarray]:
        """Token ids of each text without padding, cut at max_len exactly as `__call__` cuts them."""
        return [np.asarray(ids, np.int32) for ids in self._ids(texts, truncation=True, max_length=max_len)]

    def lengths(self, texts: list[str]) -> list[int]:
        """Token counts of each text uncut (special tokens included): what `max_len` cuts is the excess."""
        return [len(ids) for ids in self._ids(texts, truncation=False, verbose=False)]

    def token_keys(self, texts: list[str]) -> list[bytes]:
        """One key per text, a digest of its token ids (uncut, without special tokens): texts with equal keys are
        one input to the model, however their characters differ (case and accents for an uncased vocabulary,
        spacing, invisible characters)."""
        return [hashlib.blake2b(np.asarray(i, np.int64).tobytes(), digest_size=16).digest()
                for i in self._ids(texts, add_special_tokens=False, truncation=False, verbose=False)]

    def save(self, directory: str) -> None:
        self._tok.save_pretrained(directory)
