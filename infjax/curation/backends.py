"""Where the curation stages get their answers: chat requests, a response cache, token accounting.

`Backend.complete(requests)` answers a list of chat requests, one `Completion` per request, in order. A
request that cannot be answered (HTTP errors after the retries, a timeout, a body that is no chat
completion, an answer longer than its ``max_tokens`` allows) comes back with ``error`` set: a stage records
it as a failed record, the run goes on.

- `OpenAIBackend`: any OpenAI-compatible ``/chat/completions`` endpoint (``vllm serve``, SGLang, a hosted
  API). At most ``concurrency`` requests in flight, each attempt within ``timeout`` seconds in all; 429 and
  5xx answers, timeouts and broken connections are retried up to ``max_retries`` times, waiting what the
  server's ``Retry-After`` header asks (seconds or an HTTP date; at most ``max_wait``), else an exponential
  backoff; other 4xx answers are not retried. The client's secrets never leave it in what it logs or keeps.
- `LocalBackend` (curation/local.py): infjax's own Flax decoders.

Every backend goes through `ResponseCache`: one JSON file per answer under ``cache_dir``, keyed by
sha256 of (model, messages, max_tokens, temperature, seed, stop, fields), so a
rerun sends nothing it has already been
answered. `Usage` counts requests, cache hits, failures and tokens (what the server reports; what the
tokenizer counts for the local backend).
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import email.utils
import hashlib
import json
import logging
import os
import random
import re
import threading
import time
import urllib.parse

from infjax.runtime import storage

log = logging.getLogger("infjax.curation")


@dataclasses.dataclass(frozen=True)
class Request:
    """One chat request: the messages and the sampling parameters (all part of the cache key)."""

    messages: tuple[tuple[str, str], ...]        # (role, content)
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()                   # the answer ends before the first of these (OpenAI `stop`)
    # The labels of the answer's lines, in order ("NEGATIVE INSTRUCTION:", "NEGATIVE QUERY:"). The local
    # backend writes each label itself and lets the model fill in its line (the last one may run over lines
    # when there is no stop string), so that a small model answers in the format; an OpenAI-compatible
    # endpoint is asked for the whole answer (the prompt shows the format).
    fields: tuple[str, ...] = ()

    @classmethod
    def chat(cls, messages: list[dict[str, str]], **params) -> "Request":
        return cls(tuple((m["role"], m["content"]) for m in messages), **params)

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]

    def key(self, model: str) -> str:
        blob = json.dumps({"model": model, "messages": self.messages, "max_tokens": self.max_tokens,
                           "temperature": self.temperature, "seed": self.seed, "stop": self.stop,
                           "fields": self.fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Completion:
    text: str | None                 # None when the request failed
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: bool = False
    error: str | None = None


class Usage:
    """Thread-safe counters of one backend in one run."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = self.cache_hits = self.failed = self.retries = 0
        self.prompt_tokens = self.completion_tokens = 0
        self.waits: list[float] = []           # seconds waited before each retry, in order

    def add(self, **counts):
        with self._lock:
            for k, v in counts.items():
                if k == "wait":
                    self.waits.append(v)
                else:
                    setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {"requests_sent": self.requests, "cache_hits": self.cache_hits, "failed_requests": self.failed,
                "retries": self.retries, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens}


class ResponseCache:
    """Answers on disk, one JSON file per key (``<cache_dir>/<key[:2]>/<key>.json``, written then renamed)."""

    def __init__(self, folder: str | None):
        self.folder = folder

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key[:2], f"{key}.json")

    def get(self, key: str) -> dict | None:
        if not self.folder:
            return None
        try:
            with open(self._path(key), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:     # cannot happen with rename-on-write; a damaged file is asked again
            return None

    def put(self, key: str, value: dict) -> None:
        if not self.folder:
            return
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with storage.replacing(path) as f:          # never half written, never through a link
            json.dump(value, f)


class Backend:
    """Cache lookup and accounting around `_complete` (what a concrete backend implements)."""

    kind = "backend"

    def __init__(self, model: str, cache: ResponseCache):
        self.model, self.cache, self.usage = model, cache, Usage()

    def describe(self) -> str:
        return f"{self.kind}:{self.model}"

    def complete(self, requests: list[Request]) -> list[Completion]:
        out: list[Completion | None] = [None] * len(requests)
        missing = []
        for i, request in enumerate(requests):
            hit = self.cache.get(request.key(self.model))
            if hit is not None:
                out[i] = Completion(hit["text"], hit["prompt_tokens"], hit["completion_tokens"], cached=True)
                self.usage.add(cache_hits=1)
            else:
                missing.append(i)
        if missing:
            for i, answer in zip(missing, self._complete([requests[i] for i in missing])):
                out[i] = answer
                self.usage.add(requests=1)
                if answer.error is None:
                    self.usage.add(prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens)
                    self.cache.put(requests[i].key(self.model), {
                        "text": answer.text, "prompt_tokens": answer.prompt_tokens,
                        "completion_tokens": answer.completion_tokens})
                else:
                    self.usage.add(failed=1)
        return out

    def _complete(self, requests: list[Request]) -> list[Completion]:
        raise NotImplementedError


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


# An answer's length is bounded by what was asked: at most this many characters per requested token (a token
# is about 4 characters of text; the longest tokens of common vocabularies, runs of spaces or of one
# punctuation mark, a few dozen), and its body at most this many bytes besides (the JSON envelope: ids,
# usage, finish reasons) plus 12 bytes per allowed character (the longest JSON escape of one character).
CHARS_PER_TOKEN = 32
ENVELOPE_BYTES = 64 * 1024
ERROR_BODY_BYTES = 64 * 1024          # of an error answer's body, enough to show its beginning
SHOWN_BODY_CHARS = 200                # of an error body in a message
REDACTED = "***"


def answer_char_limit(max_tokens: int) -> int:
    return max_tokens * CHARS_PER_TOKEN


def answer_byte_limit(max_tokens: int) -> int:
    return ENVELOPE_BYTES + 12 * answer_char_limit(max_tokens)


_USERINFO = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)?([^/?#@]*)@")


def split_userinfo(url: str) -> tuple[str, str]:
    """(`url` without its ``user:password@`` part, that part without the "@"; "" when it has none)."""
    m = _USERINFO.match(url)
    if not m:
        return url, ""
    return (m.group(1) or "") + url[m.end():], m.group(2)


def redacted_url(url: str) -> str:
    """`url` as it may be shown: a ``user:key@`` part is replaced by ``***@``, each query value by ``***``."""
    m = _USERINFO.match(url)
    url = url if not m else (m.group(1) or "") + f"{REDACTED}@" + url[m.end():]
    head, sep, query = url.partition("?")
    query, hash_, fragment = query.partition("#")
    return head + sep + _redacted_query(query) + hash_ + fragment


def _redacted_query(query: str) -> str:
    return "&".join(f"{part.partition('=')[0]}={REDACTED}" if "=" in part else part
                    for part in query.split("&")) if query else query


# A query parameter whose value is a secret: redacted wherever the client shows text (every query value is
# redacted in the URL shown).
_SECRET_NAME = re.compile(r"key|token|secret|sig|pass|auth|cred|session|code", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where chat requests go, from a base URL such as ``https://user:key@host/v1?api-version=1``.

    ``url`` is sent (``/chat/completions`` appended to the path, before the query; the userinfo and the
    fragment left out: the userinfo is sent as Basic authentication); ``shown`` is that URL as a message
    may hold it (every query value ``***``); ``userinfo`` the ``user:password`` part; ``query_values`` the values,
    raw and decoded, of the parameters named like a secret (``?api_key=...``, ``token``, ``sig``): the client keeps
    them out of every line it shows or writes."""

    url: str
    shown: str
    userinfo: str
    query_values: tuple[str, ...]

    @classmethod
    def of(cls, base_url: str) -> "Endpoint":
        bare, userinfo = split_userinfo(base_url)
        parts = urllib.parse.urlsplit(bare)
        url = urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/chat/completions",
                                                     fragment=""))
        raw = [value for name, _, value in (part.partition("=") for part in parts.query.split("&"))
               if _SECRET_NAME.search(urllib.parse.unquote_plus(name))]
        values = tuple(sorted(v for v in {*raw, *(urllib.parse.unquote_plus(v) for v in raw)} if v))
        shown = urllib.parse.urlunsplit(parts._replace(
            netloc=f"{REDACTED}@{parts.netloc}" if userinfo else parts.netloc,
            path=parts.path.rstrip("/") + "/chat/completions", query=_redacted_query(parts.query), fragment=""))
        return cls(url, shown, userinfo, values)


def escaped(text: str) -> str:
    """`text` with every character a terminal would act on written as Python writes it in a repr.

    Those are escape sequences, control and format characters (so ``\\x1b``, ``\\n``, ``\\u200b``), written as data-set
    ids and answers are shown in messages (``{value!r}``): server text never reaches the console raw."""
    if text.isprintable():       # the common case
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class Redactor:
    """Replaces every secret the client knows in a text by ``***``.

    The secrets: the key, a URL's userinfo and each of its parts (raw and percent-decoded), and so the Authorization
    header values sent (a Basic header's base64 too), each also as a JSON string writes it (``/`` as ``\\/``). Longer
    secrets first, so that one inside another goes whole."""

    def __init__(self, secrets):
        variants = set()
        for secret in secrets:
            if not secret:
                continue
            for form in (secret, json.dumps(secret)[1:-1]):
                variants.update((form, form.replace("/", "\\/")))
        self.secrets = sorted(variants, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text


class Oversized(Exception):
    """An answer longer than its request allows (`answer_char_limit`, `answer_byte_limit`)."""


class OpenAIBackend(Backend):
    """An OpenAI-compatible chat-completions endpoint (see the module docstring).

    The server is a stranger: each attempt has a total deadline (``timeout`` seconds for the connection, the
    request and every byte of the answer: a server that sends one byte at a time cannot hold a request
    longer); an answer longer than its request's ``max_tokens`` allows is refused, unread past the bound;
    every secret the client holds is removed from the server's text (error bodies, answers) before it is
    logged, kept or written, and that text is escaped before it is shown. ``url`` is the endpoint as shown,
    its userinfo (a key in ``https://user:key@host``) replaced by ``***``.
    """

    kind = "openai"
    RETRY_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))

    def __init__(self, base_url: str, model: str, cache: ResponseCache, *, api_key: str = "",
                 concurrency: int = 8, timeout: float = 60.0, max_retries: int = 4, backoff: float = 1.0,
                 max_wait: float = 120.0):
        super().__init__(model, cache)
        import httpx

        endpoint = Endpoint.of(base_url)
        userinfo = endpoint.userinfo
        self._endpoint = endpoint.url           # sent without the userinfo: httpx never sees it
        self.url = endpoint.shown
        self.concurrency, self.max_retries, self.backoff, self.max_wait = concurrency, max_retries, backoff, max_wait
        self.timeout = timeout
        secrets = [api_key, *endpoint.query_values]
        self._headers, self._auth = {}, None
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        if userinfo:            # as httpx does for a URL with userinfo: Basic authentication, over any key
            raw_user, _, raw_password = userinfo.partition(":")
            user, password = urllib.parse.unquote(raw_user), urllib.parse.unquote(raw_password)
            self._auth = httpx.BasicAuth(user, password)
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            secrets += [userinfo, f"{user}:{password}", raw_user, raw_password, user, password, token]
        self.redact = Redactor(secrets)
        self.url = self.redact(self.url)        # a key written into the path too
        self._httpx = httpx

    def close(self):
        """Nothing is held between calls (each `complete` opens and closes its connections)."""

    def shown(self, text: str, limit: int | None = None) -> str:
        """Server text as a message may hold it: secrets redacted, then escaped, then cut at `limit` chars."""
        text = escaped(self.redact(text))
        return text if limit is None or len(text) <= limit else text[:limit] + "..."

    def _complete(self, requests: list[Request]) -> list[Completion]:
        return asyncio.run(self._complete_all(requests))

    async def _complete_all(self, requests: list[Request]) -> list[Completion]:
        httpx = self._httpx
        slots = asyncio.Semaphore(self.concurrency)

        async def one(client, request):
            async with slots:
                return await self._one(client, request)

        async with httpx.AsyncClient(headers=self._headers, auth=self._auth, timeout=httpx.Timeout(self.timeout),
                                     limits=httpx.Limits(max_connections=self.concurrency)) as client:
            return list(await asyncio.gather(*(one(client, r) for r in requests)))

    async def _wait(self, attempt: int, retry_after: float | None, problem: str) -> None:
        """Sleep before retry `attempt` + 1: what the server's Retry-After asks, else the backoff; at most
        max_wait (a server asking for a day must not stall the run silently). The log says how long."""
        wait = retry_after if retry_after is not None else self.backoff * 2 ** attempt * (1 + 0.25 * random.random())
        capped = wait > self.max_wait
        wait = min(wait, self.max_wait)
        asked = (f"; the server's Retry-After asked {retry_after:.0f} s" if retry_after is not None else "")
        log.info("request failed (%s); retry %d of %d in %.1f s%s%s", problem, attempt + 1, self.max_retries, wait,
                 asked, f", capped by --max_wait={self.max_wait:g}" if capped else "")
        self.usage.add(retries=1, wait=wait)
        await asyncio.sleep(wait)

    async def _post(self, client, body: dict, max_tokens: int) -> tuple[int, object, bytes]:
        """POST `body`; (status, headers, body bytes).

        An answer (200) past `answer_byte_limit` raises Oversized as soon as its length says so (declared or read); an
        error body is read up to ERROR_BODY_BYTES."""
        async with client.stream("POST", self._endpoint, json=body) as response:
            ok = response.status_code == 200
            limit = answer_byte_limit(max_tokens) if ok else ERROR_BODY_BYTES
            declared = response.headers.get("content-length", "")
            if ok and declared.isdigit() and int(declared) > limit:
                raise Oversized(f"{int(declared):,} bytes to a request of max_tokens={max_tokens} (at most "
                                f"{limit:,} bytes expected)")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    if ok:
                        raise Oversized(f"more than {limit:,} bytes to a request of max_tokens={max_tokens}; "
                                        f"not read further")
                    del data[limit:]
                    break
            return response.status_code, response.headers, bytes(data)

    def _refuse(self, reason: str) -> Completion:
        message = f"answer refused: {reason}"
        log.warning("%s: %s", self.url, message)
        return Completion(None, error=message)

    async def _one(self, client, request: Request) -> Completion:
        body = {"model": self.model, "messages": request.message_dicts(), "max_tokens": request.max_tokens,
                "temperature": request.temperature, "seed": request.seed}
        if request.stop:
            body["stop"] = list(request.stop)
        problem = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                async with asyncio.timeout(self.timeout):       # the whole attempt, however slowly it answers
                    status, headers, data = await self._post(client, body, request.max_tokens)
            except TimeoutError:
                problem = f"timeout (no complete answer within {self.timeout:g} s)"
            except self._httpx.TimeoutException as e:
                problem = f"timeout ({type(e).__name__})"
            except self._httpx.TransportError as e:
                problem = f"connection error ({type(e).__name__}: {self.shown(str(e), SHOWN_BODY_CHARS)})"
            except Oversized as e:
                return self._refuse(str(e))
            else:
                text = data.decode("utf-8", errors="replace")
                if status == 200:
                    try:
                        completion = _parse_completion(json.loads(text))
                    except (ValueError, LookupError, TypeError, AttributeError, ArithmeticError,
                            RecursionError) as e:     # every way a stranger's body can fail to be one
                        problem = f"not a chat completion ({type(e).__name__}: {self.shown(str(e), 120)})"
                    else:
                        limit = answer_char_limit(request.max_tokens)
                        if len(completion.text) > limit:
                            return self._refuse(f"{len(completion.text):,} characters to a request of "
                                                f"max_tokens={request.max_tokens} (at most {limit:,} expected, "
                                                f"{CHARS_PER_TOKEN} per token)")
                        return dataclasses.replace(completion, text=self.redact(completion.text))
                elif status in self.RETRY_STATUS:
                    problem = f"HTTP {status}: {self.shown(text, SHOWN_BODY_CHARS)}"
                    retry_after = retry_after_seconds(headers.get("retry-after"))
                else:
                    return Completion(None, error=f"HTTP {status} (not retried): {self.shown(text, SHOWN_BODY_CHARS)}")
            if attempt < self.max_retries:
                await self._wait(attempt, retry_after, problem)
        return Completion(None, error=f"{problem} (after {self.max_retries + 1} attempts)")


def _parse_completion(data: dict) -> Completion:
    content = data["choices"][0]["message"]["content"]
    if not isinstance(content, str):
        raise TypeError(f"message content is {type(content).__name__}")
    usage = data.get("usage") or {}
    return Completion(content, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
