"""A real HTTP endpoint that takes a feed's webhook requests, with faults on plan."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Receiver:
    """What the endpoint got: `stored` are the requests it kept (acknowledged or "stored then
    failed"), in arrival order; `plan` maps a request number (1-based) to a fault."""

    plan: dict[int, str] = field(default_factory=dict)
    always: str = ""  # a fault for every request
    seen: int = 0
    stored: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: threading.Event = field(default_factory=threading.Event)  # a "hold" request is in flight

    def messages(self) -> list[tuple[str, dict[str, Any]]]:
        """(idempotency key, message) of every stored request, keys de-duplicated as a receiver would."""
        with self.lock:
            stored = list(self.stored)
        done: set[str] = set()
        out = []
        for key, body in stored:
            if key in done:
                continue
            done.add(key)
            out += [(key, m) for m in body.get("payload", [body])]
        return out


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with rec.lock:
                rec.seen += 1
                fault = rec.always or rec.plan.get(rec.seen, "ok")
                rec.faults.append(fault)
                if fault in ("ok", "store_then_500"):
                    rec.stored.append((self.headers["Idempotency-Key"], body))
            if fault in ("hang", "hold"):
                if fault == "hold":
                    rec.held.set()  # the test kills the feed while this request waits
                time.sleep(3)  # past the client's timeout: it gives up and retries
                return
            if fault == "close":
                self.close_connection = True
                self.connection.shutdown(2)
                return
            status = {"ok": 200, "500": 500, "store_then_500": 500, "429": 429, "400": 400}[fault]
            reply = b'{"error": "bad payload: field x"}' if fault == "400" else b"{}"
            self.send_response(status)
            if fault == "429":
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield rec, f"webhook-http://127.0.0.1:{server.server_address[1]}/changes"
    server.shutdown()
