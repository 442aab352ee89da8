"""``POST /v1/pins``: pin a prompt's blocks in the engine's tiers (behind the API key).

The prompt is tokenized as ``/v1/completions`` (text or token ids) or ``/v1/chat/completions``
(messages through the chat template) would tokenize it, run once for one token so its blocks
are computed and stored (``warm``), and the chain of its full blocks is pinned in every tier of
the engine's store that can pin (``TieredStore.pin_prefix``): a sidecar behind the engine is
not pinned from here (pin there with ``cachetier pin``).
"""

from __future__ import annotations

from contextlib import aclosing

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from cachetier.engine.sampling import SamplingParams
from cachetier.engine.server.errors import APIError
from cachetier.engine.server.routes import get_serving, require_api_key
from cachetier.engine.server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from cachetier.engine.server.serving import new_id
from cachetier.errors import PinLimitError, TierUnavailableError

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | list[int] | None = Field(None, description="text, or token ids")
    messages: list[ChatMessage] | None = Field(None, description="chat messages (template)")
    warm: bool = Field(True, description="run the prompt once so its blocks are stored now")


class PinsResponse(BaseModel):
    object: str = "pins"
    num_prompt_tokens: int
    keys: list[str] = Field(description="the chain of the prompt's full blocks, in order")
    num_new: int = Field(description="how many of them were not pinned before")
    protected: dict[str, int] = Field(
        description="per tier that can pin: how many of the keys it holds and keeps now"
    )


@v1.post("/pins", response_model=PinsResponse)
async def pin(body: PinRequest, request: Request) -> PinsResponse:
    serving = get_serving(request)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.messages is not None:
        ids = serving.chat_prompt(ChatCompletionRequest(messages=body.messages))
    else:
        ids = serving.completion_prompt(CompletionRequest(prompt=body.prompt))
    engine = serving.engine.engine
    if engine.bridge is None:
        raise APIError(400, "this engine has no tiers (no store): there is nothing to pin in")
    if len(ids) < engine.namespace.block_size:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens, less than one block of "
            f"{engine.namespace.block_size}: nothing to pin",
            param="prompt",
        )
    if body.warm:
        serving.check_capacity()
        params = SamplingParams(max_tokens=1)
        run = serving.pieces(new_id("pin"), ids, params, serving.text_stream([]))
        async with aclosing(run) as pieces:
            async for _ in pieces:
                pass  # the blocks are stored when the request finishes
    try:
        result = await run_in_threadpool(engine.bridge.store.pin_prefix, engine.namespace, ids)
    except PinLimitError as exc:
        raise APIError(409, str(exc), code="pin_limit") from None
    except TierUnavailableError as exc:
        # A network tier (Redis) is down: nothing was pinned anywhere; the client may retry.
        raise APIError(503, str(exc), code="tier_unavailable") from None
    return PinsResponse(
        num_prompt_tokens=len(ids),
        keys=[k.hex() for k in result.keys],
        num_new=result.num_new,
        protected=result.protected,
    )
