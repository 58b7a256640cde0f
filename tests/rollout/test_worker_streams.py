"""The rollout worker's endless task streams."""

from __future__ import annotations

import itertools

import pytest

from envs import registry
from envs.base import in_eval_split
from rollout.worker import task_streams


def test_an_env_with_fewer_train_tasks_than_the_pool_streams_every_one_of_them_cycled():
    # code holds a few hundred train functions, fewer than the worker's pool of 2048 tasks
    config = registry.make_config("code")
    stream = task_streams(["code"], {"code": config}, seed=0)["code"]
    first = list(itertools.islice(stream, 4096))
    count = len({task.id for task in first})
    assert 0 < count < 2048
    assert [t.id for t in first[:count]] == [t.id for t in first[count : 2 * count]]
    assert not any(in_eval_split(task.id, config.eval_fraction) for task in first)
    # one with none at all fails at once, rather than handing the orchestrator an empty stream
    empty = registry.make_config("arith", max_operand=1, eval_fraction=0.99)
    with pytest.raises(ValueError, match="only 0 distinct tasks"):
        task_streams(["arith"], {"arith": empty}, seed=0)
