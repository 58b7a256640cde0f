"""AppServer, the uvicorn wrapper under the gateway's and the rollout service's HTTP APIs:
what it leaves of the host process's logging, its Unix socket's permissions and removal, and
the bound on how long a client may take to send a request."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat

import httpx
import pytest

from rollout.http_server import AppServer


async def hello(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"5")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"hello"})


async def failing(scope, receive, send):
    raise RuntimeError("the app failed")


class Recording(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.closed = False

    def emit(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True
        super().close()


@pytest.fixture
def host_logging(monkeypatch):
    """A handler on the root logger, as a host process (a Prefect worker) sets up, and
    uvicorn's loggers as they are before anything configures them."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", [])
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "level", logging.NOTSET)
    handler = Recording()
    root = logging.getLogger()
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)


def test_a_server_leaves_the_host_processs_logging_as_it_was(host_logging):
    """uvicorn's default log_config ran logging.config.dictConfig, which closes every handler
    of the process (a FileHandler opened with mode "w" then drops all it is given) and gave
    uvicorn's loggers their own stderr handler without propagation: the traceback of a
    request that failed never reached the host's handlers."""

    async def body():
        async with AppServer(failing) as server, httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return (await client.get("/")).status_code

    assert asyncio.run(body()) == 500
    assert not host_logging.closed
    assert not logging.getLogger("uvicorn").handlers
    failed = [r for r in host_logging.records if r.name == "uvicorn.error" and r.levelno == logging.ERROR]
    assert failed and "the app failed" in str(failed[0].exc_info[1])


def test_a_unix_socket_is_owner_only_and_removed_at_the_stop(tmp_path):
    """uvicorn made the socket file 0666 (anyone on the machine could connect) and left it
    behind after the stop."""
    path = str(tmp_path / "server.sock")

    async def body():
        server = await AppServer(hello, uds=path).start()
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            async with httpx.AsyncClient(
                base_url=server.url, transport=httpx.AsyncHTTPTransport(uds=path), timeout=60
            ) as client:
                text = (await client.get("/")).text
        finally:
            await server.stop()
        return mode, text

    assert asyncio.run(body()) == (0o600, "hello")
    assert not os.path.exists(path)


def test_a_start_cancelled_midway_leaves_no_unix_socket_behind(tmp_path):
    path = str(tmp_path / "server.sock")

    async def body():
        starting = asyncio.create_task(AppServer(hello, uds=path).start())
        await asyncio.sleep(0)  # start() has created the server task and waits for it to bind
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    asyncio.run(body())
    assert not os.path.exists(path)


def test_a_unix_socket_takes_the_mode_it_is_given_and_replaces_a_stale_one(tmp_path):
    """A socket file a crashed server left behind is replaced, as uvicorn replaced it."""
    path = str(tmp_path / "server.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()

    async def body():
        async with AppServer(hello, uds=path, uds_mode=0o660):
            return stat.S_IMODE(os.stat(path).st_mode)

    assert asyncio.run(body()) == 0o660


def test_a_unix_socket_another_server_listens_on_is_not_taken_from_it(tmp_path):
    """asyncio replaced any socket file at the path: a second server (a worker started twice
    with one config) silently took it from the first, whose clients then reached the second."""
    path = str(tmp_path / "server.sock")

    async def other(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
        await send({"type": "http.response.body", "body": b"other"})

    async def body():
        async with AppServer(hello, uds=path) as first:
            with pytest.raises(
                RuntimeError, match="cannot listen on Unix socket .* another server is listening"
            ):
                await AppServer(other, uds=path).start()
            async with httpx.AsyncClient(
                base_url=first.url, transport=httpx.AsyncHTTPTransport(uds=path), timeout=60
            ) as client:
                return (await client.get("/")).text

    assert asyncio.run(body()) == "hello"


def test_a_unix_socket_path_held_by_another_file_is_an_error(tmp_path):
    path = tmp_path / "server.sock"
    path.write_text("not a socket")

    async def body():
        await AppServer(hello, uds=str(path)).start()

    with pytest.raises(RuntimeError, match="cannot listen on Unix socket"):
        asyncio.run(body())
    assert path.read_text() == "not a socket"


@pytest.mark.parametrize(
    "sent",
    [
        [b""],
        [b"GET / HTTP/1.1\r\nHost: x\r\n"],
        [b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{"],
        [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"GET / HTTP/1.1\r\n"],
    ],
    ids=["nothing", "half a head", "half a body", "half a second head"],
)
def test_a_client_that_does_not_finish_its_request_in_time_is_disconnected(sent):
    """uvicorn bounds no header or body read (its keep-alive timer stops at a request's
    first byte): a client sending its request a byte a minute held a connection for ever,
    and enough of them the server's file descriptors."""

    async def body():
        async with AppServer(hello, read_timeout_s=0.2) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            *answered, last = sent
            for request in answered:
                writer.write(request)
                await asyncio.wait_for(reader.readuntil(b"hello"), 30)
            writer.write(last)
            received = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return received

    assert asyncio.run(body()) == b""


def test_a_request_may_take_longer_than_the_read_bound_once_it_is_received():
    async def slow(scope, receive, send):
        await asyncio.sleep(1.0)
        await hello(scope, receive, send)

    async def body():
        async with (
            AppServer(slow, read_timeout_s=0.2) as server,
            httpx.AsyncClient(base_url=server.url, timeout=60) as client,
        ):
            return [(await client.post("/", content=b"x" * 100_000)).text for _ in range(2)]

    assert asyncio.run(body()) == ["hello", "hello"]


def test_a_connection_past_max_connections_is_closed_at_once_and_one_comes_in_once_another_ends(caplog):
    """uvicorn accepts every connection: idle clients (each held up to read_timeout_s) could
    take the server's file descriptors, and with them the process's."""

    async def served(server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection whose request was answered, held open by the start of a second one
        (uvicorn's 5 s keep-alive timer stops), or None when the server closed it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            await asyncio.wait_for(reader.readuntil(b"hello"), 30)
        except asyncio.IncompleteReadError:
            writer.close()
            return None
        writer.write(b"GET / HTTP/1.1\r\n")
        return reader, writer

    async def body():
        async with AppServer(hello, max_connections=2, name="test") as server:
            held = [await served(server), await served(server)]
            refused = await served(server)
            _, writer = held.pop()
            writer.close()
            async with asyncio.timeout(30):  # until the server has seen the close
                while (again := await served(server)) is None:
                    await asyncio.sleep(0.01)
            for _, writer in [*held, again]:
                writer.close()
            return None not in held, refused

    assert asyncio.run(body()) == (True, None)
    assert caplog.text.count("the test server holds its max_connections 2") == 1


@pytest.mark.parametrize("limit", [0, -1])
def test_a_max_connections_below_one_is_refused(limit):
    with pytest.raises(ValueError, match="max_connections must be at least 1"):
        AppServer(hello, max_connections=limit)


@pytest.mark.parametrize(
    ("host", "url"),
    [("127.0.0.1", "http://127.0.0.1:8123"), ("::", "http://[::]:8123"), ("::1", "http://[::1]:8123")],
)
def test_the_url_of_a_server_on_an_ipv6_address_brackets_it(host, url):
    """A worker told to listen on ``::`` logged and reported its gateway at ``http://:::8123``,
    which no client parses (httpx: "Invalid port")."""
    server = AppServer(hello, host=host, port=8123)
    assert server.url == url
    assert httpx.URL(server.url).port == 8123
