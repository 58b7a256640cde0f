"""A rollout worker's failed rollouts: each committed record says why, without the run's
storage credentials."""

from __future__ import annotations

import asyncio

from envs.arith import ArithEnv
from envs.base import StepResult
from flows.config import RunConfig
from rl.models import ensure_base_version
from rollout.worker import RolloutWorker
from storage.config import RunStore
from storage.redaction import MASKED
from storage.shards import ShardReader
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY


class CredentialQuotingEnv(ArithEnv):
    """``arith`` whose step fails quoting the credentials it was given (a tool that echoed
    its environment)."""

    name = "arith"

    def __init__(self, secret: str, key_id: str):
        super().__init__()
        self.secret, self.key_id = secret, key_id

    async def step(self, action: str) -> StepResult:
        raise RuntimeError(
            f"upload failed: AWS_ACCESS_KEY_ID={self.key_id} AWS_SECRET_ACCESS_KEY={self.secret}"
        )


def test_a_workers_failed_rollouts_are_committed_with_their_reason_and_no_storage_credential(s3_server):
    store = RunStore(s3_server.config(), "errors")
    ensure_base_version(WeightStore(store), TINY)
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}, "concurrency": 2, "max_rollouts": 2})
    secret, key_id = s3_server.secret_access_key, s3_server.access_key_id

    async def body() -> None:
        worker = RolloutWorker(
            store,
            "w0",
            engine=run.engine,
            gateway=run.gateway,
            service=run.service,
            orchestrator=run.orchestrator,
            env_configs={"arith": run.env_config("arith")},
            flush_seconds=600,
        )
        worker.make_env = lambda task: CredentialQuotingEnv(secret, key_id)
        await worker.start()
        try:
            await worker.run(max_seconds=600)
        finally:
            await worker.close()

    asyncio.run(body())
    reader = ShardReader(store)
    records = [row for shard in reader.poll()[0] for row in reader.read(shard).to_pylist()]
    assert [row["status"] for row in records] == ["env_error", "env_error"]
    expected = (
        f"RuntimeError during run: upload failed: AWS_ACCESS_KEY_ID={MASKED} AWS_SECRET_ACCESS_KEY={MASKED}"
    )
    assert [row["error"] for row in records] == [expected, expected]
