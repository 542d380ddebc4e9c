"""Where the curation stages get their answers: chat requests, a response cache, token accounting.

`Backend.complete(requests)` answers a list of chat requests, one `Completion` per request, in order. A
request that cannot be answered (HTTP errors after the retries, a timeout, a body that is no chat
completion) comes back with ``error`` set: a stage records it as a failed record, the run goes on.

- `OpenAIBackend`: any OpenAI-compatible ``/chat/completions`` endpoint (``vllm serve``, SGLang, a hosted
  API). At most ``concurrency`` requests in flight; 429 and 5xx answers, timeouts and broken connections are
  retried up to ``max_retries`` times, waiting what the server's ``Retry-After`` header asks (seconds or an
  HTTP date; at most ``max_wait``), else an exponential backoff; other 4xx answers are not retried.
- `LocalBackend` (curation/local.py): infjax's own Flax decoders.

Every backend goes through `ResponseCache`: one JSON file per answer under ``cache_dir``, keyed by
sha256 of (model, messages, max_tokens, temperature, seed, stop, fields), so a
rerun sends nothing it has already been
answered. `Usage` counts requests, cache hits, failures and tokens (what the server reports; what the
tokenizer counts for the local backend).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import email.utils
import hashlib
import json
import logging
import os
import random
import threading
import time

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


class OpenAIBackend(Backend):
    """An OpenAI-compatible chat-completions endpoint (see the module docstring)."""

    kind = "openai"
    RETRY_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))

    def __init__(self, base_url: str, model: str, cache: ResponseCache, *, api_key: str = "",
                 concurrency: int = 8, timeout: float = 60.0, max_retries: int = 4, backoff: float = 1.0,
                 max_wait: float = 120.0):
        super().__init__(model, cache)
        import httpx

        self.url = base_url.rstrip("/") + "/chat/completions"
        self.concurrency, self.max_retries, self.backoff, self.max_wait = concurrency, max_retries, backoff, max_wait
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._httpx = httpx
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout),
                                    limits=httpx.Limits(max_connections=concurrency))

    def close(self):
        self._client.close()

    def _complete(self, requests: list[Request]) -> list[Completion]:
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._one, requests))

    def _wait(self, attempt: int, retry_after: float | None, problem: str) -> None:
        """Sleep before retry `attempt` + 1: what the server's Retry-After asks, else the backoff; at most
        max_wait (a server asking for a day must not stall the run silently). The log says how long."""
        wait = retry_after if retry_after is not None else self.backoff * 2 ** attempt * (1 + 0.25 * random.random())
        capped = wait > self.max_wait
        wait = min(wait, self.max_wait)
        asked = (f"; the server's Retry-After asked {retry_after:.0f} s" if retry_after is not None else "")
        log.info("request failed (%s); retry %d of %d in %.1f s%s%s", problem, attempt + 1, self.max_retries, wait,
                 asked, f", capped by --max_wait={self.max_wait:g}" if capped else "")
        self.usage.add(retries=1, wait=wait)
        time.sleep(wait)

    def _one(self, request: Request) -> Completion:
        body = {"model": self.model, "messages": request.message_dicts(), "max_tokens": request.max_tokens,
                "temperature": request.temperature, "seed": request.seed}
        if request.stop:
            body["stop"] = list(request.stop)
        problem = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                response = self._client.post(self.url, json=body)
            except self._httpx.TimeoutException as e:
                problem = f"timeout ({type(e).__name__})"
            except self._httpx.TransportError as e:
                problem = f"connection error ({type(e).__name__}: {e})"
            else:
                if response.status_code == 200:
                    try:
                        return _parse_completion(response.json())
                    except (ValueError, KeyError, IndexError, TypeError) as e:
                        problem = f"not a chat completion ({type(e).__name__}: {str(e)[:120]})"
                elif response.status_code in self.RETRY_STATUS:
                    problem = f"HTTP {response.status_code}: {response.text[:200]}"
                    retry_after = retry_after_seconds(response.headers.get("retry-after"))
                else:
                    return Completion(None, error=f"HTTP {response.status_code} (not retried): "
                                                  f"{response.text[:200]}")
            if attempt < self.max_retries:
                self._wait(attempt, retry_after, problem)
        return Completion(None, error=f"{problem} (after {self.max_retries + 1} attempts)")


def _parse_completion(data: dict) -> Completion:
    content = data["choices"][0]["message"]["content"]
    if not isinstance(content, str):
        raise TypeError(f"message content is {type(content).__name__}")
    usage = data.get("usage") or {}
    return Completion(content, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
