"""Block endpoints: put, get, exists and delete of one block or a batch; lookup; clear.

Every path names the client's namespace; the tenant comes from the token (``auth.Scope``).
Blocks travel as ``cachetier.record`` records, batches framed by ``http_batch``; uploads are
decoded and checked in full before anything is stored.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from cachetier.errors import CorruptBlockError, OverloadedError
from cachetier.primitives.keys import BlockHash, parse_key
from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE, RECORD_MEDIA_TYPE, batch_parts
from cachetier.record import Buffer
from cachetier.server.auth import Scope
from cachetier.server.bodies import (
    PartsResponse,
    binary_body,
    binary_response,
    read_batch,
    read_record,
)
from cachetier.server.deps import ScopeDep, ServiceDep
from cachetier.server.edge import busy
from cachetier.server.schemas import (
    DeletedPublic,
    KeysCreate,
    LookupPublic,
    PresentPublic,
    PutPublic,
    SpanPublic,
    api_error,
    error_responses,
)
from cachetier.server.service import BlockService

router = APIRouter(prefix="/v1/namespaces/{namespace}", tags=["blocks"])
# 503: the server holds as many upload bytes as it may (body_limit.BodyLimit); retry shortly.
_ERRORS = error_responses(400, 401, 403, 413, 415, 422, 503)
KeyPath = Annotated[str, Path(description="the block key, 64 hex digits")]


def _key(text: str) -> BlockHash:
    try:
        return parse_key(text)
    except ValueError as exc:
        raise api_error(400, "bad_key", str(exc)) from None


def _keys(body: KeysCreate, limit: int) -> list[BlockHash]:
    if len(body.keys) > limit:
        raise api_error(413, "too_large", f"{len(body.keys)} keys, at most {limit} per request")
    return [parse_key(k) for k in body.keys]  # the schema already checked the format


async def _store(
    service: BlockService,
    scope: Scope,
    records: Sequence[Buffer | None],
    keys: Sequence[BlockHash] | None,
) -> PutPublic:
    try:
        stored = await run_in_threadpool(service.store_upload, scope, records, keys)
    except CorruptBlockError as exc:
        raise api_error(400, "bad_record", str(exc)) from None
    except OverloadedError as exc:
        raise busy(str(exc)) from None
    return PutPublic(
        num_stored=max(stored.tiers.values(), default=0),
        tiers=stored.tiers,
        num_already_present=sum(stored.already_present),
        already_present=stored.already_present,
    )


@contextmanager
def _refusals_counted(service: BlockService, scope: Scope) -> Iterator[None]:
    """A body refused while it is read (its framing, its size) counts as one rejected upload
    of the caller's tenant, like a record that fails its checks."""
    try:
        yield
    except HTTPException as exc:
        if exc.status_code in (400, 413):
            service.refuse(scope, 1)
        raise


@router.put(
    "/blocks/{key}",
    response_model=PutPublic,
    responses=_ERRORS,
    openapi_extra=binary_body(RECORD_MEDIA_TYPE, "one block record carrying this key"),
)
async def put_block(
    key: KeyPath, request: Request, scope: ScopeDep, service: ServiceDep
) -> PutPublic:
    """Store one block. The body is its record (``cachetier.record``), raw bytes, no base64."""
    expected = _key(key)
    with _refusals_counted(service, scope):
        record = await read_record(request, service.config)
    return await _store(service, scope, [record], [expected])


@router.get(
    "/blocks/{key}",
    status_code=200,
    response_class=PartsResponse,
    responses={
        200: binary_response(RECORD_MEDIA_TYPE, "the block's record"),
        **error_responses(400, 401, 403, 404),
    },
)
async def get_block(key: KeyPath, scope: ScopeDep, service: ServiceDep) -> PartsResponse:
    """Fetch one block as its record (404 on a miss)."""
    found = (await run_in_threadpool(service.get_records, scope, [_key(key)]))[0]
    if found is None:
        raise api_error(404, "not_found", "no block under this key in this namespace")
    return PartsResponse(found, sum(memoryview(p).nbytes for p in found), RECORD_MEDIA_TYPE)


@router.head(
    "/blocks/{key}",
    status_code=200,
    response_class=Response,
    responses={200: {"description": "stored"}, 404: {"description": "not stored"}},
)
async def block_exists(key: KeyPath, scope: ScopeDep, service: ServiceDep) -> Response:
    """Whether one block is stored (status only, no body)."""
    present = (await run_in_threadpool(service.present, scope, [_key(key)]))[0]
    return Response(status_code=200 if present else 404)


@router.delete("/blocks/{key}", response_model=DeletedPublic, responses=_ERRORS)
async def delete_block(key: KeyPath, scope: ScopeDep, service: ServiceDep) -> DeletedPublic:
    """Remove one block from every tier."""
    return DeletedPublic(num_deleted=await run_in_threadpool(service.delete, scope, [_key(key)]))


@router.post(
    "/batch/put",
    response_model=PutPublic,
    responses=_ERRORS,
    openapi_extra=binary_body(
        BATCH_MEDIA_TYPE,
        'records framed as "CTB1" | count u32 | count x length u64 | records (little-endian); '
        "each record carries its own key. All are checked before any is stored.",
    ),
)
async def put_batch(request: Request, scope: ScopeDep, service: ServiceDep) -> PutPublic:
    """Store many blocks in one round trip."""
    with _refusals_counted(service, scope):
        records = await read_batch(request, service.config)
    return await _store(service, scope, records, None)


@router.post(
    "/batch/get",
    status_code=200,
    response_class=PartsResponse,
    responses={
        200: binary_response(
            BATCH_MEDIA_TYPE,
            "one record per key in the request's order, length 0 for a miss. When the records "
            "reach max_batch_bytes the answer stops early: it then holds records for the "
            "leading keys only (at least one), and the client asks again for the rest.",
        ),
        **_ERRORS,
    },
)
async def get_batch(body: KeysCreate, scope: ScopeDep, service: ServiceDep) -> PartsResponse:
    """Fetch many blocks in one round trip, streamed as a batch."""
    keys = _keys(body, service.config.max_batch_blocks)
    budget = service.config.max_batch_bytes
    records = await run_in_threadpool(service.get_records, scope, keys, budget)
    parts, total = batch_parts(records)
    return PartsResponse(parts, total, BATCH_MEDIA_TYPE)


@router.post("/batch/exists", response_model=PresentPublic, responses=_ERRORS)
async def exists_batch(body: KeysCreate, scope: ScopeDep, service: ServiceDep) -> PresentPublic:
    """Whether each key is stored, without reading the blocks."""
    keys = _keys(body, service.config.max_keys)
    return PresentPublic(present=await run_in_threadpool(service.present, scope, keys))


@router.post("/batch/delete", response_model=DeletedPublic, responses=_ERRORS)
async def delete_batch(body: KeysCreate, scope: ScopeDep, service: ServiceDep) -> DeletedPublic:
    """Remove many blocks from every tier."""
    keys = _keys(body, service.config.max_keys)
    return DeletedPublic(num_deleted=await run_in_threadpool(service.delete, scope, keys))


@router.post("/lookup", response_model=LookupPublic, responses=_ERRORS)
async def lookup(body: KeysCreate, scope: ScopeDep, service: ServiceDep) -> LookupPublic:
    """How many leading keys (in sequence order) are stored, and in which tier."""
    keys = _keys(body, service.config.max_keys)
    hit = await run_in_threadpool(service.lookup, scope, keys)
    spans = [SpanPublic(tier=hit.tier_names[t], start=s, end=e) for t, s, e in hit.spans]
    return LookupPublic(
        num_blocks=hit.num_blocks, spans=spans, blocks_per_tier=hit.blocks_per_tier()
    )


@router.delete("", response_model=DeletedPublic, responses=_ERRORS)
async def clear_namespace(scope: ScopeDep, service: ServiceDep) -> DeletedPublic:
    """Remove every block of this namespace (the caller's tenant only)."""
    return DeletedPublic(num_deleted=await run_in_threadpool(service.clear, scope))
