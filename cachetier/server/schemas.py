"""Pydantic models of the HTTP edge (``*Create`` = request bodies, ``*Public`` = responses).

Block bytes never pass through these: they travel as records and batches (``protocol.http_batch``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

KeyHex = Annotated[
    str,
    StringConstraints(min_length=64, max_length=64, pattern=r"^[0-9a-fA-F]{64}$"),
]


class KeysCreate(BaseModel):
    """Block keys as 64 hex digits each, in sequence order where order matters (lookup)."""

    model_config = ConfigDict(extra="forbid")

    keys: list[KeyHex] = Field(description="block keys, 64 hex digits each")


class PutPublic(BaseModel):
    num_stored: int = Field(
        description="blocks the server holds of the put (by the tier that holds the most): "
        "those stored now and those already present"
    )
    tiers: dict[str, int] = Field(description="blocks of the put each of the server's tiers holds")
    num_already_present: int = Field(
        default=0,
        description="blocks whose key the server held already: records are immutable (a key "
        "names its KV), so the record held is kept and the one sent is dropped",
    )
    already_present: list[bool] = Field(
        default_factory=list,
        description="per record of the put, in order, whether its key was held already",
    )


class PresentPublic(BaseModel):
    present: list[bool] = Field(description="per key, whether it is stored (in any tier)")


class SpanPublic(BaseModel):
    tier: str
    start: int
    end: int = Field(description="exclusive")


class LookupPublic(BaseModel):
    num_blocks: int = Field(description="how many leading keys are stored")
    spans: list[SpanPublic] = Field(description="which tier holds which part of that run")
    blocks_per_tier: dict[str, int]


class DeletedPublic(BaseModel):
    num_deleted: int


class HealthPublic(BaseModel):
    status: str


class LimitsPublic(BaseModel):
    """What this server accepts; clients split their calls to stay within it."""

    max_block_bytes: int = Field(description="largest record")
    max_batch_bytes: int = Field(description="largest batch body")
    max_batch_blocks: int = Field(description="most records per batch put, keys per batch get")
    max_keys: int = Field(description="most keys per lookup, exists or delete")
    transfer_port: int | None = Field(
        default=None,
        description="TCP port of the block transfer protocol on this server's host (batch "
        "gets and puts without HTTP), or null",
    )
    transfer_socket: str | None = Field(
        default=None,
        description="Unix socket of the block transfer protocol, for clients on this host",
    )
    transfer_id: int | None = Field(
        default=None,
        description="the id the transfer protocol's hello answers with: a client checks it "
        "reached this server",
    )
    transfer_tls: bool = Field(
        default=False,
        description="the transfer port speaks TLS (with this server's HTTPS certificate); "
        "false: plain TCP, where a client of an https URL must not send its token",
    )


class StatsPublic(BaseModel):
    tenant: str = Field(description="the caller's tenant")
    tenants: dict[str, dict[str, Any]] = Field(
        description="per tenant: hits, misses, puts, bytes_in, bytes_out, rejected (uploads "
        "that failed their checks), latency; other tenants only for admin tenants"
    )
    tiers: dict[str, dict[str, Any]] | None = Field(
        default=None, description="per tier of the server (admin tenants only)"
    )
    pending_writes: dict[str, int] | None = None
    admission: dict[str, Any] | None = Field(
        default=None,
        description="the admission policy and its decisions per lower tier (admin tenants only)",
    )
    live_curve: dict[str, dict[str, Any]] | None = Field(
        default=None,
        description="per tier: the block hit ratio its lookups would have at 0.5, 1, 2 and 4 "
        "times its capacity (admin tenants only; absent with live_curve off)",
    )


class PinsCreate(BaseModel):
    """Blocks to pin or unpin: their keys, or a token prefix whose chain of keys the server
    computes (``keys.chain_keys``, from the namespace's fingerprint)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(
        min_length=1,
        max_length=128,
        description="the client's namespace, as in /v1/namespaces/{namespace}; token_ids "
        "need a Namespace.id (64 hex digits: its fingerprint roots the chain)",
    )
    tenant: str | None = Field(
        default=None,
        max_length=32,
        description="whose namespace (admin tenants only; default: the caller's)",
    )
    keys: list[KeyHex] | None = Field(default=None, description="block keys, 64 hex digits")
    token_ids: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = Field(
        default=None, description="a token prefix: its full blocks are pinned"
    )
    block_size: int | None = Field(
        default=None, ge=1, le=1 << 16, description="tokens per block (with token_ids)"
    )


class QuarantineCreate(BaseModel):
    """A client's report that a namespace served KV that does not match its recomputation:
    the server quarantines the namespace in every tier, for every client."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(min_length=1, max_length=128, description="the client's namespace")
    reason: str = Field(default="", max_length=500, description="what differed, for the log")
    writer: str = Field(
        default="",
        pattern=r"^([0-9a-f]{16}|unknown)?$",
        description="the writer whose records differed (empty: every writer's)",
    )


class QuarantineLift(BaseModel):
    """A quarantine to end (admin tenants only)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(min_length=1, max_length=128, description="the client's namespace")
    tenant: str | None = Field(default=None, max_length=32, description="whose namespace")
    tier: str | None = Field(default=None, max_length=32, description="one tier (default all)")


class QuarantinePublic(BaseModel):
    tier: str
    tenant: str
    namespace: str
    reason: str
    since_unix_s: float
    writer: str = ""  # the writer whose records it holds back; empty for all


class QuarantinesPublic(BaseModel):
    quarantines: list[QuarantinePublic]


class PinnedPublic(BaseModel):
    tenant: str
    namespace: str
    keys: list[str] = Field(description="every key the request pinned, in order")
    num_new: int = Field(description="how many of them were not pinned before")
    protected: dict[str, int] = Field(
        description="per tier that can pin: how many of the keys it holds and keeps from "
        "eviction now; the others are kept once they arrive there"
    )


class UnpinnedPublic(BaseModel):
    num_unpinned: int = Field(description="how many of the keys were pinned")


class PinEntryPublic(BaseModel):
    tenant: str
    namespace: str
    keys: list[str]


class PinsPublic(BaseModel):
    pins: list[PinEntryPublic]
    tiers: dict[str, dict[str, int]] | None = Field(
        default=None,
        description="per tier: pinned_keys, pinned_blocks, pinned_bytes, pinned_waiting, "
        "max_pinned_bytes (admin tenants only)",
    )


class ErrorPublic(BaseModel):
    error: str = Field(description="machine-readable code, e.g. bad_record, too_large")
    message: str = Field(description="what is wrong and what to change")


def api_error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> HTTPException:
    """An ``HTTPException`` whose body is an ``ErrorPublic`` (see the app's error handlers).

    Args:
        status: HTTP status (4xx).
        code: ``ErrorPublic.error``.
        message: ``ErrorPublic.message``.
        headers: extra response headers (``WWW-Authenticate`` on a 401).

    Returns:
        The exception, for the caller to raise.
    """
    return HTTPException(status, detail={"error": code, "message": message}, headers=headers)


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries documenting ``ErrorPublic`` bodies for ``statuses``."""
    return {status: {"model": ErrorPublic} for status in statuses}
