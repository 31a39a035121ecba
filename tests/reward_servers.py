"""Reward servers written for the tests on plain http.server: flow_grpo's protocol and an
OpenAI-compatible chat endpoint. Each runs in a thread on 127.0.0.1 and records what it saw."""

from __future__ import annotations

import io
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from PIL import Image


class _Server:
    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.requests: list[dict[str, Any]] = []   # what each request carried
        self.answers: list[list[float]] = []       # the scores each request got back
        self.fail_next: list[int] = []              # HTTP codes to answer before working
        self.lock = threading.Lock()
        handler.owner = self  # type: ignore[attr-defined]
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    owner: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _reply(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _maybe_fail(self) -> bool:
        with self.owner.lock:
            code = self.owner.fail_next.pop(0) if self.owner.fail_next else 0
        if code == 302:
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:9/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        if code == -1:  # not a pickle
            self._reply(200, b"<html>gateway error</html>", "text/html")
            return True
        if code:
            self._reply(code, b"busy", "text/plain")
            return True
        return False


def mean_pixel(jpeg: bytes) -> float:
    """The server's score: mean decoded pixel value / 255."""
    return float(np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float64).mean() / 255.0)


class _FlowGRPOHandler(_Handler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self._maybe_fail():
            return
        data = pickle.loads(body)  # the test's own client: trusted
        scores = [mean_pixel(j) for j in data["images"]]
        with self.owner.lock:
            self.owner.requests.append(data)
            self.owner.answers.append(scores)
        answer = {"scores": scores, "rewards": [s > 0.5 for s in scores],
                  "strict_rewards": [s > 0.6 for s in scores],
                  "group_rewards": {"all": float(np.mean(scores))},
                  "group_strict_rewards": {"all": 0.0}}
        self._reply(200, pickle.dumps(answer), "application/octet-stream")


def flow_grpo_server() -> _Server:
    """A flow_grpo-protocol reward server scoring each image's mean pixel value."""
    return _Server(type("H", (_FlowGRPOHandler,), {}))


class _ChatHandler(_Handler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._maybe_fail():
            return
        text = next(c["text"] for c in body["messages"][0]["content"] if c["type"] == "text")
        with self.owner.lock:
            self.owner.requests.append({"path": self.path, "body": body,
                                        "auth": self.headers.get("Authorization")})
            answer = self.owner.reply(text)  # type: ignore[attr-defined]
        self._reply(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode(),
                    "application/json")


def chat_server(reply=lambda question: "Score: 7") -> _Server:
    """An OpenAI-compatible /v1/chat/completions answering ``reply(question)``."""
    s = _Server(type("H", (_ChatHandler,), {}))
    s.reply = reply  # type: ignore[attr-defined]
    return s
