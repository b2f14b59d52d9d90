"""The job-finalize rule (schemas/lua/finalize.lua) on the real Redis.

One Lua function decides a job's final status for the worker's result writer and the
producer's own answers alike; these cases pin it down where it runs, in Redis.
"""

from __future__ import annotations

from typing import Any

import pytest

from schemas.keys import RedisKeys
from schemas.redis_conn import is_cluster
from schemas.scripts import function

FINALIZE = function("finalize") + "\nreturn finalize(KEYS[1])\n"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"succeeded": 100}, "completed"),
        ({"failed": 100}, "completed_with_errors"),
        ({"succeeded": 98, "failed": 1, "expired": 1}, "completed_with_errors"),
        ({"succeeded": 50, "cancelled": 50}, "cancelled"),  # cancelled lines in a running job
        ({"succeeded": 50, "cancelled": 50, "status": "cancelling"}, "cancelled"),
        ({"succeeded": 100, "status": "cancelling"}, "cancelled"),  # cancel came too late
        ({"succeeded": 99}, "running"),  # one answer missing
        ({"succeeded": 100, "status": "submitting"}, "submitting"),  # still being published
        ({"succeeded": 100, "status": "completed"}, "completed"),  # already final: untouched
    ],
)
def test_final_status(
    redis_client: Any, prefix: str, fields: dict[str, Any], expected: str
) -> None:
    job = RedisKeys(prefix, cluster=is_cluster(redis_client)).job("j")
    redis_client.hset(job, mapping={"status": "running", "total": 100, **fields})
    assert redis_client.eval(FINALIZE, 1, job) == expected
    assert redis_client.hget(job, "status") == expected


def test_a_job_without_a_total_is_left_alone(redis_client: Any, prefix: str) -> None:
    job = RedisKeys(prefix, cluster=is_cluster(redis_client)).job("j")
    redis_client.hset(job, mapping={"status": "running", "succeeded": 5})
    assert redis_client.eval(FINALIZE, 1, job) == "running"
