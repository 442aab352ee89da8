"""Request and response bodies of the OpenAI API (the part this server implements).

Unknown request fields are ignored, as OpenAI-compatible servers do, so clients that send
newer fields keep working. ``top_k``, ``ignore_eos`` and ``return_token_ids`` are vLLM's
extensions; the ``cachetier`` object of a response is ours (where cached tokens came from).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

MAX_STOP_STRINGS = 16


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str | None = Field(None, description="the served model's name (default: it)")
    temperature: float = Field(1.0, ge=0, le=2, description="0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="vLLM extension: keep the k most likely tokens; -1 all")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="strings that end the output")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="only 1 is supported")
    user: str | None = Field(None, description="accepted and not used")
    ignore_eos: bool = Field(False, description="vLLM extension: generate past EOS")
    return_token_ids: bool = Field(
        False, description="vLLM extension: add prompt_token_ids and token_ids to each choice"
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (all tokens) or positive")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported: send one request per choice")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stop = [] if value is None else [value] if isinstance(value, str) else value
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] = Field(description="text, or token ids")
    max_tokens: int = Field(16, ge=1)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise ValueError(
                "prompt must be a string or a list of token ids (one prompt per request)"
            )
        if not value:
            raise ValueError("prompt must not be empty")
        return value


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        """The message as chat templates take it (text parts joined)."""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: what the context leaves")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class _Answer(BaseModel):
    """A response body; fields named in ``omit_none`` are left out while ``None`` (a chat
    delta is ``{}`` when it has nothing, token ids appear only when asked for)."""

    omit_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_none}


_TOKEN_FIELDS = frozenset({"prompt_token_ids", "token_ids"})


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the KV cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CacheInfo(BaseModel):
    """The ``cachetier`` extension: where the cached prompt tokens came from."""

    cached_tokens_by_source: dict[str, int] = Field(
        description="pool (the engine's own KV blocks), cpu, disk, redis or remote -> tokens"
    )
    miss_tokens_by_cause: dict[str, int] = Field(
        default_factory=dict,
        description="prompt tokens not served from cache, by cause: never_stored, evicted, "
        "not_admitted, write_dropped, namespace_mismatch, corrupt, too_slow, tier_down, "
        "partial_block, quarantined",
    )
    miss_tier: str = Field(default="", description="the tier the miss's cause concerns, if any")
    miss_detail: str = Field(
        default="",
        description="the cause in words: how old an evicted block was, which part of a "
        "mismatched namespace (model, dtype, block size, format, tenant) differs",
    )


class CompletionChoice(_Answer):
    omit_none = _TOKEN_FIELDS
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(_Answer):
    """A completion, or one chunk of a streamed one."""

    omit_none = frozenset({"cachetier"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    cachetier: CacheInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Answer):
    omit_none = _TOKEN_FIELDS
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    cachetier: CacheInfo


class ChatDelta(_Answer):
    omit_none = frozenset({"role", "content"})
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Answer):
    omit_none = _TOKEN_FIELDS
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Answer):
    omit_none = frozenset({"cachetier"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    cachetier: CacheInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cachetier"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
