"""vLLM's scheduler with qbatch's step cap in front (`worker.engines.step_cap`).

Loaded by vLLM's engine core from its qualified name (`scheduler_cls`), so it is the one
module here that imports vLLM's scheduler at import time (`vllm_engine.LANE_SCHEDULER`
names it). `LaneScheduler` picks the
asynchronous or the synchronous base at construction, whichever the engine resolved
(`async_scheduling` is decided after the arguments are parsed), so asking for it never
turns vLLM's asynchronous scheduling off.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from worker.engines.step_cap import StepCapMixin


class LaneSyncScheduler(StepCapMixin, Scheduler):
    pass


class LaneAsyncScheduler(StepCapMixin, AsyncScheduler):
    pass


class LaneScheduler:
    """A factory that vLLM calls as its scheduler class."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if vllm_config.scheduler_config.async_scheduling:
            return LaneAsyncScheduler(*args, **kwargs)
        return LaneSyncScheduler(*args, **kwargs)


__all__ = ["LaneAsyncScheduler", "LaneScheduler", "LaneSyncScheduler"]
