"""What a refused load really cost: the forward time of the steps that recomputed it, told to
the cost model once the prompt is done (``CostModel.observe_outcome``)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from cachetier.connectors.vllm.tracked import Tracked
from cachetier.store.costmodel import CostModel

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = init_logger("vllm.cachetier.scheduler")


class RefusalLearner:
    """Charges the prefill steps the worker reports to the requests whose plan was refused.

    Args:
        cost: the scheduler's cost model.
        requests: the scheduler's tracked requests, by id (read, never changed in size).
    """

    def __init__(self, cost: CostModel, requests: dict[str, Tracked]) -> None:
        self._cost = cost
        self._requests = requests
        # Per prefill step not yet reported by the worker, oldest first: the requests with a
        # refused plan that it computes prompt tokens of.
        self._steps: deque[list[str]] = deque()

    def step_planned(self, scheduler_output: SchedulerOutput) -> None:
        """Note a planned step that computes prompt tokens: the requests with a refused plan
        whose prompt tokens it computes."""
        out = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = [
            (new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs
        ]
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_computed in scheduled:
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.refused_plan is None or tracked.prompt_scheduled:
                continue
            out.append(req_id)
            if num_computed + num_scheduled.get(req_id, 0) >= tracked.request.num_prompt_tokens:
                tracked.prompt_scheduled = True
        self._steps.append(out)

    def step_reported(self, seconds: float) -> None:
        """Charge one reported prefill step to the refused requests it computed; a request
        whose prompt is done then tells the cost model what its refusal really cost."""
        if not self._steps:
            return
        for req_id in self._steps.popleft():
            tracked = self._requests.get(req_id)
            if tracked is None or tracked.refused_plan is None:
                continue
            tracked.refused_compute_s += seconds
            if tracked.prompt_scheduled:
                self._cost.observe_outcome(
                    tracked.refused_plan, tracked.refused_compute_s, request_id=req_id
                )
                logger.info(
                    "request %s: the refused load's prompt took %.3f s of forward against "
                    "%.3f s estimated",
                    req_id,
                    tracked.refused_compute_s,
                    tracked.refused_plan.est_compute_s or 0.0,
                )
                tracked.refused_plan = None
