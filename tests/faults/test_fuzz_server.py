"""Issue 7, part 5: bad input over HTTP. Generated inputs against every endpoint of a real
server (schemathesis over its OpenAPI document, and hypothesis over raw bodies and tokens);
names that try to leave the disk root are ``test_fuzz_paths``.

What must hold: the server never answers 5xx, a forged token or an oversized body gets its 4xx,
a record of another namespace is never served, and nothing is read or written outside the
disk root.

Figures: ``fuzz_inputs`` and ``fuzz_crashes`` (see ``tests.faults.fuzzing.Tally``).
"""

from __future__ import annotations

import http.client
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import given
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE, RECORD_MEDIA_TYPE
from cachetier.record import KVBlock, decode_record, encode_record
from cachetier.store.tiered import TieredStore
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.faults.fuzzing import (
    ALICE,
    FUZZ_NS,
    KNOWN_BLOCKS,
    OTHER_NS,
    Tally,
    frame,
    fuzz_settings,
    head_len_of,
    mutations,
    serve_inside,
    with_canary,
)
from tests.server.live import TOKENS, ThreadServer, call
from tests.support import make_blocks


@pytest.fixture(scope="module")
def outer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_canary(tmp_path_factory.mktemp("fuzz-outer"))


@pytest.fixture(scope="module")
def server(outer: Path) -> Iterator[ThreadServer]:
    yield from serve_inside(outer)


@st.composite
def record_bodies(draw: st.DrawFn) -> bytes:
    """Record bodies: valid ones, changed ones and random bytes."""
    block = draw(st.sampled_from(KNOWN_BLOCKS))
    how = draw(st.sampled_from(["valid", "changed", "random"]))
    if how == "random":
        return draw(st.binary(max_size=300))
    record = encode_record(block)
    return record if how == "valid" else draw(mutations(record, head_len_of(block)))[0]


@pytest.fixture(scope="module")
def openapi_schema(server: ThreadServer) -> schemathesis.BaseSchema:
    records = record_bodies()
    # Schemathesis cannot make the binary bodies from the document alone (they are framed
    # bytes): it is told how, so it reaches past the media-type check.
    schemathesis.openapi.media_type(RECORD_MEDIA_TYPE, records)
    schemathesis.openapi.media_type(
        BATCH_MEDIA_TYPE,
        st.one_of(
            st.lists(st.none() | records, max_size=4).map(frame),
            st.binary(max_size=300),
            st.binary(max_size=300).map(lambda tail: b"CTB1" + tail),
        ),
    )
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@pytest.mark.parametrize(
    ("mode", "auth", "paths", "num_examples"),
    [
        # Authenticated as alice, claiming alice, with namespaces and keys that exist: requests
        # get past auth and path checks to the handlers and the store.
        (GenerationMode.POSITIVE, "claimed", "known", 800),
        (GenerationMode.NEGATIVE, "claimed", "known", 400),
        # Made-up namespaces and keys.
        (GenerationMode.POSITIVE, "claimed", "any", 300),
        (GenerationMode.NEGATIVE, "claimed", "any", 300),
        # Only the token fixed: schemathesis also makes up the tenant claim header.
        (GenerationMode.POSITIVE, "token", "any", 150),
        # Nothing fixed: made-up tokens and claims.
        (GenerationMode.NEGATIVE, "none", "any", 150),
    ],
    ids=lambda v: getattr(v, "value", v),
)
def test_every_endpoint_from_the_openapi_document(
    tally: Tally,
    server: ThreadServer,
    openapi_schema: schemathesis.BaseSchema,
    mode: GenerationMode,
    auth: str,
    paths: str,
    num_examples: int,
) -> None:
    headers = {
        "claimed": {"Authorization": f"Bearer {ALICE}", "X-Cachetier-Tenant": "alice"},
        "token": {"Authorization": f"Bearer {ALICE}"},
        "none": {},
    }[auth]
    cases = openapi_schema.as_strategy(generation_mode=mode, headers=headers)
    if paths == "known":
        keys = [b.key.hex() for b in KNOWN_BLOCKS]
        cases = st.one_of(
            *[
                openapi_schema.as_strategy(
                    generation_mode=mode,
                    headers=headers,
                    path_parameters={"namespace": namespace, "key": key},
                )
                for namespace in (FUZZ_NS.id, "plain-fuzz")
                for key in keys[:2]
            ]
        )
    session = requests.Session()

    @fuzz_settings(num_examples)
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        tally.num_inputs += 1
        response = case.call(session=session, timeout=30)
        tally.answer(f"{case.method} {case.path}", response.status_code)

    try:
        run()
    finally:
        session.close()
    assert call(server.url, "GET", "/healthz")[0] == 200


def forged(block: KVBlock, fingerprint: bytes) -> KVBlock:
    """``block`` claiming another namespace: same key bytes, other fingerprint, valid checksum
    (what a record of another model, dtype or layout filed under this key looks like)."""
    return KVBlock(
        block.key, fingerprint, block.dtype, block.shape, block.num_tokens, block.data, block.aux
    )


def test_raw_bodies_to_the_binary_endpoints(tally: Tally, server: ThreadServer) -> None:
    pool = make_blocks(FUZZ_NS, 4, seed=4)
    pool.append(forged(pool[0], OTHER_NS.fingerprint))
    right_type = {"one": RECORD_MEDIA_TYPE, "batch": BATCH_MEDIA_TYPE}
    # Every record accepted under a key, across examples: a tier keeps the first it holds and
    # skips later puts of the key (a key names its tokens' KV), so a forged but well-formed
    # record put after another under the same key is not what comes back.
    accepted: dict[tuple[str, bytes], set[bytes]] = {}

    @fuzz_settings(800)
    @given(
        data=st.data(),
        endpoint=st.sampled_from(["one", "batch"]),
        namespace=st.sampled_from([FUZZ_NS.id, OTHER_NS.id, "plain-fuzz"]),
        picks=st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=4),
        content_type=st.sampled_from(["right"] * 6 + ["application/json", "text/plain", None]),
    )
    def run(
        data: st.DataObject,
        endpoint: str,
        namespace: str,
        picks: list[int],
        content_type: str | None,
    ) -> None:
        tally.num_inputs += 1
        fingerprint = bytes.fromhex(namespace) if namespace != "plain-fuzz" else None
        records, expected = [], 200
        for i in picks[: 1 if endpoint == "one" else 4]:
            record = encode_record(pool[i])
            how = data.draw(st.sampled_from(["as is", "as is", "changed", "random"]))
            if how == "random":
                record = data.draw(st.binary(max_size=300))
            elif how == "changed":
                record, resealed = data.draw(mutations(record, head_len_of(pool[i])))
                if resealed:
                    expected = None  # a forged but well-formed record: its checks decide
            if record != encode_record(pool[i]) and expected == 200:
                expected = 400
            if fingerprint is not None and pool[i].fingerprint != fingerprint:
                expected = 400  # another namespace's record is refused
            records.append(record)
        if endpoint == "one":
            key = pool[data.draw(st.sampled_from([picks[0], 1]))].key
            if key != pool[picks[0]].key:
                expected = 400
            path, body = f"/v1/namespaces/{namespace}/blocks/{key.hex()}", records[0]
        else:
            path, body = f"/v1/namespaces/{namespace}/batch/put", frame(records)
            if data.draw(st.booleans()):
                changed = data.draw(mutations(body, None))[0]
                if changed != body:
                    body, expected = changed, None  # 400, or 413 for a huge claimed length
        method = "PUT" if endpoint == "one" else "POST"
        ctype = right_type[endpoint] if content_type == "right" else content_type
        if ctype != right_type[endpoint]:
            expected = 415
        status, _, answer = call(server.url, method, path, body, token=ALICE, content_type=ctype)
        tally.answer(f"{method} {path.split('/')[-1]}", status)
        if expected is None:
            assert status in (200, 400, 413), answer
        else:
            assert status == expected, answer
        if status == 200:
            # What was accepted is served back exactly as it decodes, under its own key: one
            # of the records accepted under that key.
            for record in records:
                sent = decode_record(record)
                accepted.setdefault((namespace, sent.key), set()).add(encode_record(sent))
            for key in {decode_record(record).key for record in records}:
                got = call(
                    server.url, "GET", f"/v1/namespaces/{namespace}/blocks/{key.hex()}", token=ALICE
                )
                assert got[0] == 200 and got[2] in accepted[(namespace, key)]

    run()


@st.composite
def forged_authorizations(draw: st.DrawFn) -> bytes | None:
    """An Authorization header value no tenant owns (``None``: no header at all)."""
    token = draw(st.sampled_from(sorted(TOKENS.values()))).encode()
    kind = draw(
        st.sampled_from(
            ["random", "text", "truncated", "one char", "empty", "huge", "scheme", "none"]
        )
    )
    if kind == "none":
        return None
    if kind == "random":
        # Any bytes but CR and LF (those would end the header, not make a token).
        value = draw(st.binary(min_size=1, max_size=80)).replace(b"\r", b"").replace(b"\n", b"")
    elif kind == "text":
        value = (
            draw(st.text(alphabet=st.characters(max_codepoint=255), max_size=80))
            .encode("latin-1")
            .replace(b"\r", b"")
            .replace(b"\n", b"")
        )
    elif kind == "truncated":
        value = token[: draw(st.integers(0, len(token) - 1))]
    elif kind == "one char":
        at = draw(st.integers(0, len(token) - 1))
        other = draw(
            st.sampled_from(b"0123456789abcdefxyzXYZ-_.~+/=").filter(lambda c: c != token[at])
        )
        value = token[:at] + bytes([other]) + token[at + 1 :]
    elif kind == "empty":
        return draw(st.sampled_from([b"", b"Bearer", b"Bearer ", b"Bearer  "]))
    elif kind == "huge":
        value = token * draw(st.integers(2, 4000))
    else:
        return draw(st.sampled_from([b"Basic ", b"Token ", b"Bearer: ", b""])) + token
    return b"Bearer " + value


def raw_call(
    url: str, method: str, path: str, headers: list[tuple[str, bytes]], body: bytes | None = None
) -> tuple[int, bytes]:
    """One request with header values sent as the bytes given (``call`` takes text only)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest(method, path)
        for name, value in headers:
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_forged_tokens_are_refused(tally: Tally, server: ThreadServer) -> None:
    block = make_blocks(FUZZ_NS, 1, seed=11)[0]
    path = f"/v1/namespaces/{FUZZ_NS.id}/blocks/{block.key.hex()}"
    put = call(
        server.url, "PUT", path, encode_record(block), token=ALICE, content_type=RECORD_MEDIA_TYPE
    )
    assert put[0] == 200, put

    @fuzz_settings(600)
    @given(
        authorization=forged_authorizations(),
        claim=st.none() | st.sampled_from([b"alice", b"bob", b"nobody", b"x" * 300]),
        method=st.sampled_from(["GET", "HEAD", "DELETE"]),
    )
    def run(authorization: bytes | None, claim: bytes | None, method: str) -> None:
        tally.num_inputs += 1
        headers = [] if authorization is None else [("Authorization", authorization)]
        headers += [] if claim is None else [("X-Cachetier-Tenant", claim)]
        status, body = raw_call(server.url, method, path, headers)
        tally.answer(f"{method} with a forged token", status)
        # 400: the HTTP parser refused the header itself (e.g. a NUL byte in it); 431: the
        # forged token made the head longer than max_head_bytes.
        assert status in (400, 401, 403, 431), (status, body)

    run()
    # Another tenant's valid token claiming alice is refused, and alice's block is intact.
    bob_as_alice = [
        ("Authorization", f"Bearer {TOKENS['bob']}".encode()),
        ("X-Cachetier-Tenant", b"alice"),
    ]
    assert raw_call(server.url, "GET", path, bob_as_alice)[0] == 403
    assert call(server.url, "GET", path, token=ALICE)[2] == encode_record(block)


def chunked_call(url: str, path: str, content_type: str, chunks: Iterator[bytes]) -> int:
    """A request whose body is sent chunked (no Content-Length to refuse it by)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": content_type}
    try:
        conn.request("POST", path, body=chunks, encode_chunked=True, headers=headers)
        response = conn.getresponse()
        status = response.status
        assert b"too_large" in response.read()
        return status
    except (BrokenPipeError, ConnectionResetError):
        # The server answered and hung up while the client was still sending: read below.
        return 413
    finally:
        conn.close()


def test_oversized_bodies_get_a_413_and_the_server_stays_up(
    tally: Tally, server: ThreadServer
) -> None:
    limits = server.config
    ns = f"/v1/namespaces/{FUZZ_NS.id}"
    key = make_blocks(FUZZ_NS, 1)[0].key.hex()
    too_many_keys = json.dumps({"keys": [key] * (limits.max_keys + 1)}).encode()
    # One JSON string far longer than any list of keys can be.
    huge_json = b'{"keys": ["' + b"0" * (2 * limits.max_batch_bytes) + b'"]}'
    cases = [
        ("PUT", f"{ns}/blocks/{key}", RECORD_MEDIA_TYPE, bytes(limits.max_block_bytes + 1)),
        ("POST", f"{ns}/batch/put", BATCH_MEDIA_TYPE, bytes(limits.max_batch_bytes + 1)),
        (
            "POST",
            f"{ns}/batch/put",
            BATCH_MEDIA_TYPE,
            struct.pack("<4sI", b"CTB1", limits.max_batch_blocks + 1),
        ),
        (
            "POST",
            f"{ns}/batch/put",
            BATCH_MEDIA_TYPE,
            struct.pack("<4sIQ", b"CTB1", 1, limits.max_block_bytes + 1),
        ),
        ("POST", f"{ns}/lookup", "application/json", too_many_keys),
        ("POST", f"{ns}/batch/get", "application/json", huge_json),
        ("POST", f"{ns}/batch/exists", "application/json", huge_json),
    ]
    for method, path, content_type, body in cases:
        tally.num_inputs += 1
        status, headers, answer = call(
            server.url, method, path, body, token=ALICE, content_type=content_type
        )
        tally.answer(f"{method} {path} with {len(body)} bytes", status)
        assert status == 413, (path, answer[:200])
        error = json.loads(answer)
        message = error["message"]
        assert error["error"] == "too_large" and ("limit" in message or "at most" in message)
    # Without a Content-Length the limit cuts in while the body arrives.
    for path, content_type in [
        (f"{ns}/batch/put", BATCH_MEDIA_TYPE),
        (f"{ns}/lookup", "application/json"),
    ]:
        tally.num_inputs += 1
        head = b"CTB1" if content_type == BATCH_MEDIA_TYPE else b'{"keys": ["'
        chunks = iter([head] + [b"0" * (1 << 20)] * (limits.max_batch_bytes // (1 << 20) + 2))
        status = chunked_call(server.url, path, content_type, chunks)
        tally.answer(f"chunked POST {path}", status)
        assert status == 413, path
    assert call(server.url, "GET", "/healthz")[0] == 200


def test_a_record_of_another_namespace_is_never_served(
    tally: Tally, server: ThreadServer, outer: Path
) -> None:
    # Same key bytes as a block of FUZZ_NS, but made under OTHER_NS (another dtype).
    mine = make_blocks(FUZZ_NS, 1, seed=21)[0]
    theirs = forged(mine, OTHER_NS.fingerprint)
    path = f"/v1/namespaces/{FUZZ_NS.id}/blocks/{mine.key.hex()}"
    tally.num_inputs += 1
    status, _, answer = call(
        server.url, "PUT", path, encode_record(theirs), token=ALICE, content_type=RECORD_MEDIA_TYPE
    )
    assert status == 400 and b"another namespace" in answer
    # Filed on the server's disk anyway (a copied file, a bug elsewhere): still a miss.
    folder = outer / "data" / "blocks" / f"t.alice.{FUZZ_NS.id}" / mine.key.hex()[:2]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{mine.key.hex()}.ctkv").write_bytes(encode_record(theirs))
    tally.num_inputs += 1
    status, _, answer = call(server.url, "GET", path, token=ALICE)
    assert status == 404, "a record of another namespace was served"
    keys = json.dumps({"keys": [mine.key.hex()]}).encode()
    tally.num_inputs += 1
    status, _, answer = call(
        server.url,
        "POST",
        f"/v1/namespaces/{FUZZ_NS.id}/batch/get",
        keys,
        token=ALICE,
        content_type="application/json",
    )
    assert status == 200 and answer == frame([None]), "a record of another namespace was served"
    # The engine's path: the store checks the fingerprint it expects.
    tier = DiskTier(DiskTierConfig(str(outer / "data" / "blocks"), 1 << 30, fsync=False))
    store = TieredStore([tier])
    restored = store.restore_prefix(
        f"t.alice.{FUZZ_NS.id}", [mine.key], fingerprint=FUZZ_NS.fingerprint
    )
    store.close()
    assert restored.blocks == ()
