"""An HTTP proxy in front of the S3 test server, for tests that need the store to misbehave
in one precise way (throttle a request, lose a reply, cut a body short)."""

from __future__ import annotations

import contextlib
import http.server
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping

from tests.conftest import serving

HOP_HEADERS = ("transfer-encoding", "content-length", "connection", "server", "date")
"""Headers of the upstream answer that the proxy sets itself (or leaves to its own server)."""


class S3Proxy(http.server.BaseHTTPRequestHandler):
    """Passes every request on to ``upstream`` (the S3 server) and its answer back, with
    keep-alive as S3 serves. A subclass changes what it must in :meth:`relay` with
    :meth:`forward` and :meth:`answer`."""

    protocol_version = "HTTP/1.1"
    upstream = ""

    def relay(self) -> None:
        """Answer the request (any method)."""
        self.answer(*self.forward())

    def do_GET(self):
        self.relay()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def forward(self) -> tuple[int, Mapping[str, str], bytes]:
        """The upstream's status, headers and body for this request."""
        length = int(self.headers.get("Content-Length") or 0)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        headers.setdefault("Content-Type", "application/octet-stream")  # not urllib's form type
        request = urllib.request.Request(
            self.upstream + self.path,
            data=self.rfile.read(length) if length else None,
            method=self.command,
            headers=headers,
        )
        try:
            with urllib.request.urlopen(request) as reply:
                return reply.status, dict(reply.headers), reply.read()
        except urllib.error.HTTPError as refused:
            return refused.code, dict(refused.headers), refused.read()

    def answer(self, status: int, headers: Mapping[str, str], body: bytes, length: int | None = None) -> None:
        """Send ``status``, ``headers`` and ``body`` with a ``Content-Length`` of ``length``
        (default: the body's; for a HEAD, the upstream's)."""
        if length is None:
            length = int(headers.get("Content-Length") or 0) if self.command == "HEAD" else len(body)
        self.send_response(status)
        for key, value in headers.items():
            if key.lower() not in HOP_HEADERS:
                self.send_header(key, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def proxying(handler: type[S3Proxy], upstream: str) -> Iterator[str]:
    """Serve ``handler`` on 127.0.0.1 in front of ``upstream`` while the block runs; yields
    the proxy's endpoint URL."""
    handler.upstream = upstream
    with serving(handler) as url:
        yield url
