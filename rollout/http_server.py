"""Serve an ASGI app with uvicorn inside the running event loop (TCP on 127.0.0.1 or a Unix
socket), and the one-line reason the apps answer a body they cannot take with (:func:`bad_body`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import stat
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

UNWIND_TIMEOUT_S = 60.0
"""Seconds a stop waits for the requests its drain cut short to unwind (a rollout closing its env)."""


def bearer_token(token: str | None) -> str:
    """``token``, or a fresh random one when none is given; ``ValueError`` for one that an
    ``Authorization`` header cannot carry (no request could match it)."""
    header = f"Bearer {token}"
    if token and not (header.isascii() and header.isprintable() and header == header.rstrip()):
        raise ValueError(
            "the bearer token must be printable ASCII with no whitespace at its end: an Authorization "
            "header cannot carry it as it is, so no request would match it"
        )
    return token or secrets.token_urlsafe(24)


def bad_body(exc: RequestValidationError) -> str:
    """The one-line message of a 400 for a request body that does not parse or validate."""
    return "bad request body: " + "; ".join(_body_problem(error) for error in exc.errors())


def _body_problem(error: dict[str, Any]) -> str:
    """One validation error of a request body, for people: FastAPI locates a JSON syntax error
    by its character offset, which would read as a field name."""
    if error.get("type") == "json_invalid":
        reason = error.get("ctx", {}).get("error", error.get("msg"))
        return f"not valid JSON: {reason} (char {error['loc'][-1]})"
    if error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",):
        return "the request has no body; send a JSON object"
    where = ".".join(_location(p) for p in error.get("loc", ()) if p != "body")
    return f"{where}: {error.get('msg')}" if where else str(error.get("msg"))


def _location(part: str | int) -> str:
    # a key the client sent, quoted when it holds a line break or other control character,
    # so that the message stays one line
    return str(part) if str(part).isprintable() else repr(part)


ErrorBody = Callable[[int, str], dict[str, Any]]
"""The JSON body of an error answered outside the app (a 413, a 503 at the stop), from its
status and message: the app's own errors' shape, so that its clients read them alike."""


def detail_body(status: int, message: str) -> dict[str, Any]:
    """FastAPI's error shape, ``{"detail": message}``: :class:`AppServer`'s default."""
    return {"detail": message}


MAX_BODY_BYTES = 256 * 2**20
"""The largest request body a server reads; a larger one is refused (413) before it is read
or parsed, as is one sent without a length that grows past it."""


DRAIN_TIMEOUT_S = 30.0
"""How long :meth:`AppServer.stop` lets the requests in flight finish; those still running
then are cancelled and answered 503 (the server is stopping). Without a bound, one client
that stalls mid-body (or a request whose work never ends) held the stop, and a worker's
shutdown behind it, for ever."""


READ_TIMEOUT_S = 60.0
"""Seconds a client has to send a request, head and body, from the opening of its connection
(on a kept-alive one, from the first byte of its next request); a client still sending then
is disconnected. uvicorn bounds neither: its keep-alive timer stops at a request's first
byte, so a client sending a byte a minute held a connection, and its file descriptor, for ever."""

MAX_CONNECTIONS: int | None = None
"""The most connections a server holds open at once (None: no bound but the process's file
descriptors). One past it is closed as soon as it is accepted, before a byte is read: uvicorn's
``limit_concurrency`` still accepts it, and answers its requests 503 while as many connections
are open, so idle connections of a client that cannot send a request refuse those that can."""

UDS_MODE = 0o600
"""Permissions of a server's Unix socket: only its owner may connect (uvicorn made it 0666)."""


class _ReadBoundH11(H11Protocol):
    """uvicorn's h11 protocol, disconnecting a client whose request has not fully arrived
    ``read_timeout_s`` after its connection opened or its first byte did, and closing a
    connection past ``max_connections`` at once (a subclass per server sets them)."""

    read_timeout_s = READ_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    server_name = "local"
    warned = False  # of a connection past max_connections: later ones are not logged

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_deadline: asyncio.TimerHandle | None = None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            if not self.warned:
                type(self).warned = True
                log.warning(
                    "the %s server holds its max_connections %d: it closes each connection past "
                    "them as it comes (later ones are not logged)",
                    self.server_name,
                    self.max_connections,
                )
            transport.close()
            return
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._receiving():
            if self._read_deadline is None:
                self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        elif self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None
        super().connection_lost(exc)

    def _receiving(self) -> bool:
        # IDLE: the head has not fully arrived; SEND_BODY: the body has not
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self._receiving():
            self.transport.close()


class _BodyTooLarge(HTTPException):
    # an HTTPException, so that a FastAPI app reading the body answers it (413), not as a
    # body it failed to parse (400)
    def __init__(self, limit: int):
        super().__init__(413, _too_large(limit))


class _BodyLimit:
    """ASGI wrapper of ``app`` that refuses a request body over ``limit`` bytes with a 413,
    and gives the app no body of a request without ``Authorization: Bearer <token>`` (when
    a token is given): the app reads and parses a body before it checks the bearer token, so
    anyone who can connect could otherwise have the server hold one as large as its memory,
    or, parsed, several times ``limit`` (a list of small ints takes 8 bytes an item)."""

    def __init__(self, app, limit: int, token: str | None = None, error_body: ErrorBody | None = None):
        self.app, self.limit = app, limit
        self.error_body = error_body or detail_body
        self.token = None if token is None else token.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return await _answer(send, 413, _too_large(self.limit), self.error_body)
        if self.token is not None and not _authorized(scope, self.token):
            # the app answers it (401, or /health's answer) from its headers alone
            return await self.app(scope, _without_body(receive), send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise _BodyTooLarge(self.limit)
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await _answer(send, 413, _too_large(self.limit), self.error_body)


def _authorized(scope, token: bytes) -> bool:
    # the first Authorization header, the one the app checks
    return bearer_matches(
        next((value for name, value in scope["headers"] if name == b"authorization"), None), token
    )


def bearer_matches(authorization: str | bytes | None, token: bytes) -> bool:
    """Whether an ``Authorization`` header's value is ``Bearer token``, its scheme in any case
    (``bearer``: HTTP reads an auth scheme so), the token compared in constant time."""
    if authorization is None:
        return False
    if isinstance(authorization, str):
        authorization = authorization.encode()
    scheme, _, sent = authorization.partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(sent, token)


def _without_body(receive):
    """``receive`` of a request whose body is left unread: an empty one first."""
    given = False

    async def empty():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": b"", "more_body": False}

    return empty


async def _answer(send, status: int, detail: str, error_body: ErrorBody) -> None:
    body = json.dumps(error_body(status, detail))
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body.encode()})


def _too_large(limit: int) -> str:
    return f"the request body is over {limit} bytes (or its Content-Length is not a number)"


class _AnsweredOnStop:
    """ASGI wrapper of ``app`` that answers a request the end of the drain cancels (once
    ``stopping`` is set) with a 503 saying the server stops: uvicorn answered it a bare 500
    "Internal Server Error" and logged a traceback for each (40 at a worker's SIGTERM under
    40 harness requests). One whose response has started (a stream) cannot be answered
    again: its connection closes."""

    def __init__(self, app, name: str, drain_timeout_s: float, error_body: ErrorBody):
        self.app, self.name, self.drain_timeout_s = app, name, drain_timeout_s
        self.error_body = error_body
        self.stopping = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if started or not self.stopping:
                raise
            detail = (
                f"the {self.name} server is stopping: the request did not finish within "
                f"its {self.drain_timeout_s} s drain"
            )
            await _answer(send, 503, detail, self.error_body)


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn would take SIGINT and SIGTERM for as long as it serves, so that a Ctrl-C or a
        # SIGTERM sent to the process would stop this server (its clients' requests failing)
        # rather than reach the process that embeds it, as asyncio.run's own handler does
        yield


def _listening(path: str) -> bool:
    """Whether a server accepts connections on the Unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return False
    except BlockingIOError:  # its backlog is full
        return True
    finally:
        probe.close()
    return True


class AppServer:
    """Runs ``app`` under uvicorn as a task of the current event loop.

    Binds 127.0.0.1 by default (``port=0`` picks a free port) or a Unix domain socket (``uds``);
    for a socket, clients use ``http://<name>`` with an httpx ``uds`` transport. The socket file
    is made with ``uds_mode`` before it listens (a stale socket at its path is replaced, one
    another server listens on is not) and removed at the stop. ``token`` is the bearer token
    ``app`` requires: a request without it reaches the app with its body unread. ``error_body``
    shapes the errors answered outside ``app`` (413, and 503 at the stop) as ``app`` shapes its
    own. A client has ``read_timeout_s`` to send a request (see :data:`READ_TIMEOUT_S`); a
    connection past ``max_connections`` is closed at once (see :data:`MAX_CONNECTIONS`).
    """

    def __init__(
        self,
        app,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | None = None,
        uds_mode: int = UDS_MODE,
        name: str = "local",
        max_body_bytes: int = MAX_BODY_BYTES,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int | None = MAX_CONNECTIONS,
        token: str | None = None,
        error_body: ErrorBody = detail_body,
    ):
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections must be at least 1 (or None: no bound), not {max_connections}")
        self._answering = _AnsweredOnStop(
            _BodyLimit(app, max_body_bytes, token, error_body), name, drain_timeout_s, error_body
        )
        config = uvicorn.Config(
            self._answering,
            host=host,
            port=port,
            uds=uds,
            http=type(
                "_ReadBoundH11",
                (_ReadBoundH11,),
                {"read_timeout_s": read_timeout_s, "max_connections": max_connections, "server_name": name},
            ),
            # uvicorn's default log_config runs logging.config.dictConfig, which closes every
            # handler of the process and cuts uvicorn's loggers off from the host's handlers
            log_config=None,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=drain_timeout_s,
        )
        self.app = app
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None
        self.uds = uds
        self.uds_mode = uds_mode
        self._bound: os.stat_result | None = None
        self.host = host
        self.port = port
        self.name = name

    @property
    def url(self) -> str:
        if self.uds:
            return f"http://{self.name}"
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"http://{host}:{self.port}"

    async def start(self):
        """Start serving; returns once the socket is bound (cancelled, it stops the server first)."""
        if (self._task is None or self._task.done()) and self._server.started:
            # it ran and stopped: uvicorn's server serves once
            self._server = _EmbeddedServer(self._server.config)
            self._answering.stopping = False
        self._task = asyncio.create_task(self._serve())
        try:
            while not self._server.started:
                if self._task.done():
                    self._task.result()
                    raise RuntimeError(f"the {self.name} server stopped before it started")
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            # a caller cancelled meanwhile leaves no server running (its socket bound) for nobody
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            raise
        if not self.uds:
            self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    async def _serve(self) -> None:
        # uvicorn exits the process (SystemExit) when it cannot bind; that must reach the
        # caller as an error it can handle, not end the worker
        where = f"Unix socket {self.uds}" if self.uds else f"{self.host}:{self.port}"
        try:
            sockets = [self._bind_uds()] if self.uds else None
        except OSError as exc:
            raise RuntimeError(f"the {self.name} server cannot listen on {where}: {exc}") from None
        try:
            await self._server.serve(sockets=sockets)
        except SystemExit as exc:
            raise RuntimeError(f"the {self.name} server cannot listen on {where} (exit {exc.code})") from None
        finally:
            if sockets:
                self._remove_uds()

    def _bind_uds(self) -> socket.socket:
        """The server's Unix socket, bound with its mode set before it listens: uvicorn set the
        mode after listening, a window in which anyone could connect and stay connected."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(self.uds).st_mode):
                # asyncio replaced any socket, taking the path from a server still serving on it
                if _listening(self.uds):
                    raise OSError(errno.EADDRINUSE, "another server is listening on it")
                os.remove(self.uds)  # a stale socket: its server is gone
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.uds)
            os.chmod(self.uds, self.uds_mode)
            self._bound = os.stat(self.uds)
        except OSError:
            sock.close()
            raise
        return sock

    def _remove_uds(self) -> None:
        """Remove the socket file, unless another server has bound its path since."""
        bound, self._bound = self._bound, None
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(self.uds)
            if bound is not None and (now.st_dev, now.st_ino) == (bound.st_dev, bound.st_ino):
                os.remove(self.uds)

    async def stop(self) -> None:
        """Stop serving and wait for the server task to end: the requests in flight finish, or
        are cancelled after ``drain_timeout_s`` and answered 503. Cancelled, it leaves the
        server stopping (a later call waits for it)."""
        if self._task is None:
            return
        self._answering.stopping = True
        self._server.should_exit = True
        # a cancel of the caller must not cancel uvicorn midway: before it closes its socket,
        # that left the server accepting and serving for the process's life
        await asyncio.shield(self._task)
        self._task = None
        # uvicorn cancels the requests still running when the drain ends but does not wait for
        # them: they unwind (a rollout closes its env) and answer their 503 before this returns
        cut = set(self._server.server_state.tasks)
        if cut:
            _, stuck = await asyncio.wait(cut, timeout=UNWIND_TIMEOUT_S)
            if stuck:  # a request whose unwinding hangs must not hold the stop for ever
                log.warning(
                    "the %s server stopped with %d requests still unwinding %s s after their cancel",
                    self.name,
                    len(stuck),
                    UNWIND_TIMEOUT_S,
                )

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
