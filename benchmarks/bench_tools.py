"""Tool-call latency: a command in the persistent pty bash vs a fresh ``bash -c`` per command.

Both run under the same isolation backend (bwrap when installed), side by side in one run.
``ratio`` = fresh-process median / persistent median (targets: persistent median <= 5 ms,
ratio >= 10). The rollout service's HTTP round trip (Unix socket vs loopback TCP) is measured
by :func:`bench_http_transport`, filled in with the service.
"""

from __future__ import annotations

import json
import statistics
import time

from envs.sandbox import Sandbox, SandboxConfig
from envs.shell import Shell

COMMAND = "echo $((6 * 7))"


def median_ms(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def bench_shell(repeats: int = 200) -> dict:
    """Median round trip of ``COMMAND`` in the persistent shell and in a fresh sandboxed bash."""
    with Sandbox(SandboxConfig(timeout_s=30)) as sandbox:
        shell = Shell(sandbox)
        assert shell.run(COMMAND).output == "42\n"
        assert sandbox.run(COMMAND).output == "42\n"
        persistent = median_ms(lambda: shell.run(COMMAND), repeats)
        fresh = median_ms(lambda: sandbox.run(COMMAND), max(repeats // 4, 10))
        return {
            "backend": sandbox.backend,
            "persistent_median_ms": round(persistent, 3),
            "fresh_median_ms": round(fresh, 3),
            "ratio": round(fresh / persistent, 2),
        }


def bench_http_transport() -> dict:
    """Request round trip over a Unix socket vs loopback TCP for the rollout service's HTTP API."""
    return {}


def main() -> None:
    shell = bench_shell()
    print(f"persistent pty bash: {shell['persistent_median_ms']} ms median per command ({shell['backend']})")
    print(f"fresh bash -c:       {shell['fresh_median_ms']} ms median per command")
    print(json.dumps({"bench": "tools", **shell, **bench_http_transport()}))


if __name__ == "__main__":
    main()
