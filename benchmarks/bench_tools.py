"""Tool-call latency: a command in the persistent pty bash vs a fresh ``bash -c`` per command.

Both run under the same isolation backend (bwrap when installed), side by side in one run,
the same number of times, alternating.
``ratio`` = fresh-process median / persistent median (targets: persistent median <= 5 ms,
ratio >= 10). :func:`bench_http_transport` also times a request round trip to the rollout
service's HTTP API (``GET /status`` with the bearer token) over a Unix domain socket against
loopback TCP, same service, same run, requests alternating between the two; its figures join
the JSON line (``tcp_over_uds`` = TCP median / socket median).

    python benchmarks/bench_tools.py
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import httpx

from envs import registry
from envs.sandbox import Sandbox, SandboxConfig
from envs.shell import Shell
from rollout.gateway import Gateway, GatewayConfig
from rollout.router import Router
from rollout.service import RolloutService
from rollout.service_http import ServiceServer

COMMAND = "echo $((6 * 7))"


def alternated_medians_ms(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each side over ``repeats`` calls, the sides taking turns, so
    that the machine's drift (neighbours' load) reaches both alike."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, call in sides.items():
            started = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(values) for name, values in samples.items()}


def bench_shell(repeats: int = 100) -> dict:
    """Median round trip of ``COMMAND`` in the persistent shell and in a fresh sandboxed bash,
    alternated."""
    with Sandbox(SandboxConfig(timeout_s=30)) as sandbox:
        shell = Shell(sandbox)
        assert shell.run(COMMAND).output == "42\n"
        assert sandbox.run(COMMAND).output == "42\n"
        median = alternated_medians_ms(
            {"persistent": lambda: shell.run(COMMAND), "fresh": lambda: sandbox.run(COMMAND)}, repeats
        )
        return {
            "backend": sandbox.backend,
            "persistent_median_ms": round(median["persistent"], 3),
            "fresh_median_ms": round(median["fresh"], 3),
            "ratio": round(median["fresh"] / median["persistent"], 2),
        }


def bench_http_transport(requests: int = 400) -> dict:
    """Median round trip of ``GET /status`` to the rollout service over a Unix socket and
    over loopback TCP, on a kept-alive connection and on a new connection per request."""
    return asyncio.run(_http_transport(requests))


async def _http_transport(requests: int) -> dict:
    gateway = Gateway(Router([]), config=GatewayConfig(vocab_size=2))
    service = RolloutService(gateway, lambda task: registry.make(task.env))
    with tempfile.TemporaryDirectory(prefix="bench-tools-") as folder:
        token = "bench-token"
        async with (
            ServiceServer(service, token=token) as tcp,
            ServiceServer(service, token=token, uds=os.path.join(folder, "service.sock")) as uds,
        ):
            clients = {}
            for kind, server in (("tcp", tcp), ("uds", uds)):
                for reuse in (True, False):
                    limits = httpx.Limits(max_keepalive_connections=None if reuse else 0)
                    transport = httpx.AsyncHTTPTransport(uds=server.uds, limits=limits)
                    clients[kind, reuse] = httpx.AsyncClient(
                        base_url=server.url,
                        transport=transport,
                        headers={"Authorization": f"Bearer {token}"},
                    )
            samples: dict[tuple[str, bool], list[float]] = {key: [] for key in clients}
            for round_ in range(requests + 20):
                for key, client in clients.items():
                    started = time.perf_counter()
                    response = await client.get("/status")
                    elapsed = (time.perf_counter() - started) * 1000
                    response.raise_for_status()
                    if round_ >= 20:
                        samples[key].append(elapsed)
            for client in clients.values():
                await client.aclose()
    median = {key: statistics.median(values) for key, values in samples.items()}
    return {
        "http_requests": requests,
        "uds_median_ms": round(median["uds", True], 3),
        "tcp_median_ms": round(median["tcp", True], 3),
        "tcp_over_uds": round(median["tcp", True] / median["uds", True], 2),
        "uds_new_connection_median_ms": round(median["uds", False], 3),
        "tcp_new_connection_median_ms": round(median["tcp", False], 3),
    }


def main() -> None:
    shell = bench_shell()
    print(f"persistent pty bash: {shell['persistent_median_ms']} ms median per command ({shell['backend']})")
    print(f"fresh bash -c:       {shell['fresh_median_ms']} ms median per command")
    http = bench_http_transport()
    print(
        f"rollout service GET /status: {http['uds_median_ms']} ms over a Unix socket, "
        f"{http['tcp_median_ms']} ms over loopback TCP (kept-alive connection); "
        f"{http['uds_new_connection_median_ms']} / {http['tcp_new_connection_median_ms']} ms "
        "with a new connection per request"
    )
    print(json.dumps({"bench": "tools", **shell, **http}))


if __name__ == "__main__":
    main()
