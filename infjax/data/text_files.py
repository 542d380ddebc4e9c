"""Where a text file a user gave stops being UTF-8: one place for every reader of text files.

Training data, evaluation files (corpus, queries, qrels, pools) and curation input all report bytes that
are not UTF-8 the same way, `FILE: line N (byte M): not UTF-8 text (REASON)`, wherever in the file they are.
Readers decode as usual and, when Python's decoder fails, call `not_utf8` for the position (the error
path reads the file again; the normal path costs nothing).
"""
from __future__ import annotations

import codecs

CHUNK = 1 << 24


def _newlines_before(path: str, end: int, chunk: int = CHUNK) -> int:
    """The number of b"\\n" in the first `end` bytes of `path`."""
    count, done = 0, 0
    with open(path, "rb") as f:
        while done < end:
            block = f.read(min(chunk, end - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def not_utf8(path: str, chunk: int = CHUNK) -> str | None:
    """"line N (byte M): not UTF-8 text (REASON)" for the first byte of `path` that is not UTF-8, else None.

    Read in chunks: a large file is never held in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0                                     # bytes handed to the decoder so far
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            held = len(decoder.getstate()[0])      # an unfinished character carried over from the last block
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                byte = offset - held + e.start
                return f"line {_newlines_before(path, byte, chunk) + 1} (byte {byte}): not UTF-8 text ({e.reason})"
            if not block:
                return None
            offset += len(block)


def describe_not_utf8(path: str) -> str:
    """`FILE: line N (byte M): not UTF-8 text (REASON)`, for a reader whose decoding of `path` just failed."""
    return f"{path}: {not_utf8(path) or 'not UTF-8 text'}"
