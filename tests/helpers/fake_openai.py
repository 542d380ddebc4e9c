"""A real HTTP server, in a thread of the test process, that speaks OpenAI's chat-completions API.

`FakeChat(script)` listens on 127.0.0.1 (a free port); every POST to ``/v1/chat/completions`` (any query) is
recorded, its path and query apart, and answered by ``script(body, n)`` (the parsed request and its 0-based arrival number), which returns a
`Reply`: an HTTP status, headers, and either a chat completion's text (wrapped as the API does, with token
usage) or a raw body; ``delay`` seconds are slept first (a slow or hanging server); with ``drip`` the body
(with ``drip_headers`` the status line and headers too) is sent one byte every ``drip`` seconds (a server that
answers for ever); with ``length=False`` the body has no Content-Length and ends when the connection closes.
"""
from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
from typing import Callable


@dataclasses.dataclass
class Reply:
    text: str | None = None          # the assistant's answer (status 200)
    status: int = 200
    headers: dict = dataclasses.field(default_factory=dict)
    raw: str | bytes | None = None   # a body sent as is (errors, broken JSON; bytes: not even UTF-8)
    delay: float = 0.0
    drip: float = 0.0                # seconds between the bytes of the body (0: all at once)
    drip_headers: bool = False       # the status line and headers dripped too
    length: bool = True              # send a Content-Length (else the body ends when the connection closes)


class FakeChat:
    def __init__(self, script: Callable[[dict, int], Reply]):
        self.script = script
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.closed = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):      # keep the test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                path, _, query = self.path.partition("?")
                with outer.lock:
                    n = len(outer.requests)
                    outer.requests.append({"body": body, "path": path, "query": query, "time": time.monotonic(),
                                           "auth": self.headers.get("Authorization")})
                if path != "/v1/chat/completions":
                    reply = Reply(status=404, raw='{"error": "not found"}')
                else:
                    reply = outer.script(body, n)
                if reply.delay and outer.closed.wait(reply.delay):
                    return
                if reply.raw is not None:
                    payload = reply.raw if isinstance(reply.raw, bytes) else reply.raw.encode()
                else:
                    prompt = " ".join(m["content"] for m in body["messages"])
                    payload = json.dumps({
                        "id": f"chatcmpl-{n}", "object": "chat.completion", "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": reply.text}}],
                        "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(reply.text.split()),
                                  "total_tokens": len(prompt.split()) + len(reply.text.split())}}).encode()
                headers = {"Content-Type": "application/json", **reply.headers}
                if reply.length:
                    headers["Content-Length"] = str(len(payload))
                else:
                    headers["Connection"] = "close"
                    self.close_connection = True
                try:
                    if reply.drip:
                        head = f"HTTP/1.1 {reply.status} Whatever\r\n" + "".join(
                            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
                        if not reply.drip_headers:
                            self.wfile.write(head.encode())
                        for byte in (head.encode() if reply.drip_headers else b"") + payload:
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            if outer.closed.wait(reply.drip):
                                return
                        return
                    self.send_response(reply.status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):     # the client gave up (a timeout test)
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()

    def count(self, stage: str | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.requests if stage is None or stage_of(r["body"]) == stage)


def stage_of(body: dict) -> str:
    """Which curation stage a request comes from (the first words of its template)."""
    text = body["messages"][-1]["content"]
    for start, stage in (("You write instructions", "instruct"), ("You make hard negatives", "poison"),
                         ("Write the passage", "negative"), ("You judge search results", "verify")):
        if text.startswith(start):
            return stage
    return "unknown"


def field(text: str, label: str) -> str:
    """The value of the first ``label: value`` line of a prompt."""
    for line in text.splitlines():
        if line.startswith(label + ": "):
            return line[len(label) + 2:]
    raise KeyError(label)
