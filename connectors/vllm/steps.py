"""What the scheduler side reads off vLLM's own objects: a step's prefill work, and whether a
request's KV is a function of its token ids alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachetier.connectors.vllm.metadata import CacheTierConnectorMetadata
from cachetier.store.costmodel import PrefillModel

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def describe_step(scheduler_output: SchedulerOutput, meta: CacheTierConnectorMetadata) -> None:
    """Fill the step's prefill features: its tokens and attention work, if it computes a prompt
    chunk (a decode-only step would teach the prefill model the one-token case only)."""
    num_scheduled = scheduler_output.num_scheduled_tokens
    attention = 0.0
    prefill = False
    for new in scheduler_output.scheduled_new_reqs:
        n = num_scheduled.get(new.req_id, 0)
        attention += PrefillModel.attention_work(n, new.num_computed_tokens)
        prefill = prefill or n > 1
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        n = num_scheduled.get(req_id, 0)
        attention += PrefillModel.attention_work(n, cached.num_computed_tokens[i])
        prefill = prefill or n > 1
    if prefill:
        meta.step_tokens = scheduler_output.total_num_scheduled_tokens
        meta.step_attention = attention


def cacheable(request: Request) -> bool:
    """Whether the request's KV is a function of its token ids alone (what keys cover)."""
    return (
        request.prompt_token_ids is not None
        and request.prompt_embeds is None
        and not request.mm_features
        and request.lora_request is None
    )
