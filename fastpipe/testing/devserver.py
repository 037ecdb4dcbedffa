"""A loopback HTTP server for a folder, with Range requests, added latency and injected faults,
or a proxy that puts the same faults in front of another server (an S3-protocol one).

For the tests and `benchmarks/bench_remote.py`: a real HTTP server that fsspec's HTTP filesystem talks to over
real sockets, so that remote reading is tested and measured without a network. Faults, each every Nth request
(counted over all requests, so that concurrent clients meet them too): a 503, a connection reset before any
response, or a stall longer than the client's timeout. And two hostile servers, for every matching request: one that
trickles its answer a byte at a time (each byte in time for the client's read timeout), one that announces a huge
body and sends without end; and one that redirects each matching request (to another server, or a path of its own).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass
class Faults:
    latency: float = 0.0  # seconds added to every request (a store's time to first byte)
    error_every: int = 0  # every Nth request answers 503 Slow Down
    reset_every: int = 0  # every Nth request has its connection closed without a response
    stall_every: int = 0  # every Nth request waits `stall` seconds before answering
    stall: float = 0.0
    only: str = ""  # faults only for requests whose line ("GET /path") holds this (".tar"); latency: all
    trickle: float = 0.0  # seconds between the bytes of each matching answer
    endless: bool = False  # each matching answer: a Content-Length of a terabyte, and zeros until the client leaves
    redirect: str = ""  # each matching GET or HEAD answers 302 to this prefix + its path ('http://other:port', '/x')

    def __post_init__(self):
        self.lock, self.count = threading.Lock(), 0
        self.requests = self.errors = self.resets = self.stalls = 0
        self.answered: list[str] = []  # the request line of every request answered ("GET /set/dataset.json HTTP/1.1")

    def next(self, path: str = "") -> str | None:
        if self.only not in path:
            with self.lock:
                self.requests += 1
            return None
        with self.lock:
            self.count += 1
            self.requests += 1
            n = self.count
        for kind, every in (("reset", self.reset_every), ("error", self.error_every), ("stall", self.stall_every)):
            if every and n % every == 0:
                with self.lock:
                    setattr(self, kind + "s", getattr(self, kind + "s") + 1)
                return kind
        return None


class _Handler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a store's clients use it

    def __init__(self, *args, faults: Faults, **kw):
        self.faults = faults
        super().__init__(*args, **kw)

    def log_message(self, *args):  # quiet
        pass

    def log_request(self, code="-", size="-"):
        with self.faults.lock:
            self.faults.answered.append(self.requestline)

    def _faulted(self) -> bool:
        """Apply this request's latency and fault; True when the fault was the whole answer (a reset, a 503)."""
        fault = self.faults.next(f"{self.command} {self.path}")
        if self.faults.latency:
            time.sleep(self.faults.latency)
        if fault == "reset":
            self.close_connection = True
            self.connection.shutdown(2)
            return True
        if fault == "error":  # S3's throttling answer, which s3fs and botocore recognise
            self._reply(503, b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
                             b"</Error>", {"Content-Type": "application/xml"})
            return True
        if fault == "stall":
            time.sleep(self.faults.stall)
        return False

    def _hostile(self) -> bool:
        """The trickling or endless answer, when this request is one for them."""
        if not (self.faults.trickle or self.faults.endless) or self.faults.only not in f"GET {self.path}":
            return False
        self.close_connection = True
        try:
            if self.faults.endless:
                self._head(200, 1 << 40)
                while True:
                    self.wfile.write(bytes(1 << 16))
            path = Path(self.translate_path(self.path))
            data = path.read_bytes() if path.is_file() else b"not found"
            self._head(200, len(data))
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(self.faults.trickle)
        except OSError:  # the client gave up: what it should do
            pass
        return True

    def _redirected(self) -> bool:
        """The redirect, when this request is one for it."""
        if not self.faults.redirect or self.faults.only not in f"{self.command} {self.path}":
            return False
        with self.faults.lock:
            self.faults.requests += 1
        self._head(302, 0, {"Location": self.faults.redirect + self.path})
        return True

    def do_GET(self):
        if self._redirected() or self._faulted() or self._hostile():
            return
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            return self._reply(404, b"not found")
        size = path.stat().st_size
        m = RANGE_RE.match(self.headers.get("Range", ""))
        start, end = (int(m.group(1)), min(size, int(m.group(2)) + 1 if m.group(2) else size)) if m else (0, size)
        if start >= size and size:
            return self._reply(416, b"range not satisfiable")
        with open(path, "rb") as f:
            span = {"Content-Range": f"bytes {start}-{end - 1}/{size}"} if m else {}
            self._head(206 if m else 200, end - start, span)
            # from the page cache to the socket in the kernel: a store's CPU is not the client's, and in the
            # benchmark this server shares the client's cores, so it should take as little of them as it can
            sent, sock = 0, self.connection.fileno()
            while sent < end - start:
                n = os.sendfile(sock, f.fileno(), start + sent, end - start - sent)
                if n == 0:  # the file shrank under us: the client sees a short body and retries
                    self.close_connection = True
                    return
                sent += n

    def do_HEAD(self):
        if self._redirected():
            return
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            return self._reply(404, b"")
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def _reply(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self._head(status, len(body), headers)
        self.wfile.write(body)

    def _head(self, status: int, length: int, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()


class _Proxy(_Handler):
    """Forwards every request to `target` (an S3-protocol server such as moto's), with the same faults."""

    def __init__(self, *args, target: str, **kw):
        self.target = target
        super().__init__(*args, **kw)

    def _forward(self):
        import http.client

        if self._faulted():
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = http.client.HTTPConnection(self.target.split("://", 1)[1], timeout=60)
        conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
        r = conn.getresponse()
        data = r.read()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("content-length", "connection", "transfer-encoding", "server", "date"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


class _Server(ThreadingHTTPServer):
    # socketserver's default backlog is 5: with 16 requests in flight from each of several processes, connections
    # beyond it see their SYN dropped and retried after 1, 2, 4... s (a minute in all), which a store never does.
    request_queue_size = 1024


class FolderServer:
    """`with FolderServer(folder, Faults(...)) as url:` serves `folder` at http://127.0.0.1:PORT; with
    `proxy_to=URL` it forwards to that server instead (faults in front of an S3-protocol server)."""

    def __init__(self, folder: str | os.PathLike | None, faults: Faults | None = None, proxy_to: str | None = None):
        self.faults = faults or Faults()
        handler = (partial(_Proxy, target=proxy_to, faults=self.faults) if proxy_to else
                   partial(_Handler, directory=str(folder), faults=self.faults))
        self.httpd = _Server(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


__all__ = ["Faults", "FolderServer"]
