"""How many texts an encoder's maximum length cuts, counted where the encoder tokenizes them.

A text is cut when its uncut token count, special tokens included, is above
max_len. The count is read off the tokenizer call that makes the encoder's
input, so no text is tokenized a second time to count it: a fast (Rust)
tokenizer keeps, for each text, what truncation removed. Where a tokenizer's
output does not say (a slow tokenizer, a library that returns plain tensors),
a text cut shows as one that fills max_len, and only those are tokenized
again, uncut, to tell them from texts of exactly max_len tokens.

`tokens` and `padded` make the very call that `Tokenizer.tokens` and
`Tokenizer.__call__` make (`Tokenizer.encoded`: the same ids), keeping its
encodings, of which those return nothing; without a count to fill they are
those methods.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from infjax.data import tokenize
from infjax.data.tokenize import Tokenizer

Lengths = Callable[[list[str]], list[int]]       # texts -> uncut token counts, special tokens included


@dataclasses.dataclass
class Cuts:
    """The texts an encoder read at `max_len` tokens at most, and how many of them that length cut.

    A text is uncounted where nothing said whether it was cut (its embedding came from a cache entry that kept no count,
    or the tokenizer's output did not say); `cut_count` is then unknown."""

    max_len: int
    texts: int = 0
    cut: int = 0                 # of the counted texts
    uncounted: int = 0

    def add(self, texts: int, cut: int | None) -> None:
        """`texts` more texts, `cut` of them cut (None: not known)."""
        self.texts += texts
        if cut is None:
            self.uncounted += texts
        else:
            self.cut += cut

    def add_flags(self, flags: np.ndarray | None, texts: int) -> None:
        """`texts` more texts, with their cut flags (None: not known)."""
        self.add(texts, None if flags is None else int(np.count_nonzero(flags)))

    @property
    def cut_count(self) -> int | None:
        """The texts cut, None (unknown) when some were not counted."""
        return None if self.uncounted else self.cut

    def since(self, before: Cuts) -> Cuts:
        """What was added after `before` (an earlier copy of this count)."""
        return Cuts(self.max_len, self.texts - before.texts, self.cut - before.cut,
                    self.uncounted - before.uncounted)

    def reset(self) -> None:
        self.texts = self.cut = self.uncounted = 0


def cut_flags(encoded, texts: list[str], max_len: int, lengths: Lengths) -> np.ndarray | None:
    """Whether `max_len` cut each of `texts`, read off `encoded`; None when it has not one row per text.

    `encoded` is a tokenizer's output for exactly these texts cut at max_len (a BatchEncoding, or a dict with
    `attention_mask` or unpadded `input_ids`). A fast
    tokenizer's encodings keep what truncation removed (`overflowing`); otherwise the texts that fill max_len
    are tokenized again uncut (`lengths`)."""
    encodings = getattr(encoded, "encodings", None)
    if encodings is not None and len(encodings) == len(texts):
        return np.fromiter((bool(e.overflowing) for e in encodings), bool, len(texts))
    rows = encoded.get("attention_mask")
    rows = encoded.get("input_ids") if rows is None else [np.asarray(m).nonzero()[0] for m in rows]
    if rows is None or len(rows) != len(texts):
        return None
    filled = [i for i, r in enumerate(rows) if len(r) >= max_len]
    flags = np.zeros(len(texts), bool)
    if filled:
        flags[filled] = np.asarray(lengths([texts[i] for i in filled])) > max_len
    return flags


def tokens(tokenizer: Tokenizer, texts: list[str], max_len: int, cuts: Cuts | None) -> list[np.ndarray]:
    """`tokenizer.tokens(texts, max_len)`, counting into `cuts` (when given) the texts and those max_len cuts.

    The count comes from the same tokenizer calls (tokenize.CHUNK texts each)."""
    if cuts is None:
        return tokenizer.tokens(texts, max_len)
    out = []
    for start in range(0, len(texts), tokenize.CHUNK):
        part = list(texts[start:start + tokenize.CHUNK])
        encoded = tokenizer.encoded(part, max_len)
        cuts.add_flags(cut_flags(encoded, part, max_len, tokenizer.lengths), len(part))
        out += [np.asarray(ids, np.int32) for ids in encoded["input_ids"]]
    return out


def padded(tokenizer: Tokenizer, texts: list[str], max_len: int, cuts: Cuts | None,
           counted: int) -> tuple[np.ndarray, np.ndarray]:
    """`tokenizer(texts, max_len)` (ids and mask [N, max_len]), counting the first `counted` texts into `cuts`.

    The others pad a batch to its static size; `cuts` may be None (no count)."""
    if cuts is None:
        return tokenizer(texts, max_len)
    encoded = tokenizer.encoded(texts, max_len, padded=True)
    flags = cut_flags(encoded, texts, max_len, tokenizer.lengths)
    cuts.add_flags(None if flags is None else flags[:counted], counted)
    return encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)
