"""Text formats (query template, prefixes) and the tokenizer: fixed-shape ids, pieces, identity."""
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

    def query_parts(self) -> QueryParts | None:
        """`query` as constant texts around its two fields, for assembling it from the fields' own tokens.

        None for a template that names a field more than once."""
        import string

        parsed = [(lit, field) for lit, field, _, _ in string.Formatter().parse(self.query_template)]
        if [f for _, f in parsed if f is not None] not in (["query", "instruction"], ["instruction", "query"]):
            return None
        (lit0, first), (lit1, second), *rest = parsed
        lit2 = rest[0][0] if rest else ""
        # query() strips the formatted template; the fields are stripped and start and end with a visible
        # character, so only the outer literals lose their outer whitespace.
        head, mid, tail = self.query_prefix + lit0.lstrip(), lit1, lit2.rstrip()
        return QueryParts(head.rstrip(), (first, head[len(head.rstrip()):]), mid.rstrip(),
                          (second, mid[len(mid.rstrip()):]), tail)


@dataclasses.dataclass(frozen=True)
class QueryParts:
    """An instruction-aware query as five texts in a row: `head`, first field, `middle`, second field, `tail`.

    The constants lose their trailing whitespace to the field that follows (`(name, whitespace)`), as the
    byte-level BPE tokenizers read it (" word" is one token); WordPiece tokenizers ignore it either way.
    `TextFormat().query_parts()` is ("", ("query", ""), "", ("instruction", " "), "")."""

    head: str
    first: tuple[str, str]
    middle: str
    second: tuple[str, str]
    tail: str

    def text(self, fields: dict[str, str]) -> str:
        """The query text these parts make of `fields` ({"query": ..., "instruction": ...})."""
        (a, ws_a), (b, ws_b) = self.first, self.second
        return self.head + ws_a + fields[a] + self.middle + ws_b + fields[b] + self.tail


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


# Texts tokenized in one call of the Hugging Face tokenizer at most (`Tokenizer.tokens`, `lengths`):
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
        out = self.encoded(texts, max_len, padded=True)
        return out["input_ids"].astype(np.int32), out["attention_mask"].astype(np.int32)

    @property
    def pad_id(self) -> int:
        return int(self._tok.pad_token_id)

    def specials(self) -> tuple[list[int], list[int]] | None:
        """The special tokens the tokenizer puts before and after a text's own ids: (before, after).

        [CLS] and [SEP] for BERT, BOS for Llama, none for Qwen2; read off one text encoded with and without
        them. None when they are not the text's ids with tokens around them."""
        probe = "infjax probe text"
        bare = self._tok(probe, add_special_tokens=False)["input_ids"]
        full = self._tok(probe)["input_ids"]
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return full[:start], full[start + len(bare):]
        return None

    def identity(self) -> str:
        """A digest of what the tokenizer does to text: equal for two folders that tokenize alike.

        Its whole pipeline as the tokenizers library serializes it, the special tokens it adds, its padding and
        truncation sides; not its path or its files' dates."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        h = hashlib.blake2b(digest_size=16)
        h.update(type(self._tok).__name__.encode())
        h.update(backend.to_str().encode() if backend is not None else repr(sorted(self._tok.get_vocab().items())).encode())
        h.update(repr((self.specials(), self.pad_id, self._tok.padding_side, self._tok.truncation_side)).encode())
        return h.hexdigest()

    @property
    def truncation_side(self) -> str:
        return self._tok.truncation_side

    def _ids(self, texts: list[str], **kwargs):
        """The tokenizer's input_ids of `texts`, CHUNK texts at a time.

        Its per-text encodings (tokens, offsets, masks) of one chunk at most are alive at once, whatever the
        number of texts."""
        for start in range(0, len(texts), CHUNK):
            yield from self._tok(list(texts[start:start + CHUNK]), **kwargs)["input_ids"]

    def encoded(self, texts: list[str], max_len: int, padded: bool = False):
        """The tokenizer's own output for `texts` cut at max_len, special tokens included.

        Padded to max_len when `padded` (numpy arrays): its ids and, for a fast tokenizer, each text's encoding
        (what the cut removed among it). `tokens` and `__call__` return the ids of this very call."""
        if padded:
            return self._tok(list(texts), padding="max_length", truncation=True, max_length=max_len,
                             return_tensors="np")
        return self._tok(list(texts), truncation=True, max_length=max_len)

    def encode(self, texts: list[str], max_len: int | None = None, special: bool = False) -> list[list[int]]:
        """The ids of `texts` in one call: uncut and without special tokens by default.

        With `max_len`, cut at it (special tokens included when `special`)."""
        if not texts:
            return []
        cut = {"truncation": True, "max_length": max_len} if max_len else {"truncation": False}
        return self._tok(list(texts), add_special_tokens=special, verbose=False, **cut)["input_ids"]

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can give (its vocabulary and added tokens)."""
        return len(self._tok)

    def tokens(self, texts: list[str], max_len: int) -> list[np.ndarray]:
        """Token ids of each text without padding, cut at max_len exactly as `__call__` cuts them."""
        return [np.asarray(ids, np.int32) for ids in self._ids(texts, truncation=True, max_length=max_len)]

    def lengths(self, texts: list[str]) -> list[int]:
        """Token counts of each text uncut (special tokens included): what `max_len` cuts is the excess."""
        return [len(ids) for ids in self._ids(texts, truncation=False, verbose=False)]

    def save(self, directory: str) -> None:
        self._tok.save_pretrained(directory)
