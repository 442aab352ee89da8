"""Tokens, tenants and isolation: no token or a wrong one is refused, and two tenants with the
same prompts can neither read, overwrite, delete nor detect each other's blocks."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import pytest

from cachetier.primitives.keys import Namespace
from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE
from cachetier.record import encode_record
from cachetier.server.config import ServerConfig, load_config
from tests.server.batches import batch_body, get_batch, put_batch
from tests.server.live import TOKENS, ThreadServer, call, call_json
from tests.support import make_blocks

ALICE, BOB = TOKENS["alice"], TOKENS["bob"]


@pytest.mark.parametrize(
    "headers,status",
    [
        ({}, 401),
        ({"Authorization": "Bearer not-a-token-of-this-server"}, 401),
        ({"Authorization": f"Basic {ALICE}"}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": f"Bearer {ALICE}", "X-Cachetier-Tenant": "bob"}, 403),
    ],
)
def test_requests_without_a_valid_token_are_refused(
    shared_server: ThreadServer, own_namespace: Namespace, headers: dict, status: int
) -> None:
    block = make_blocks(own_namespace, 1)[0]
    url, ns = shared_server.url, own_namespace.id
    for method, path, body, ctype in [
        ("POST", f"/v1/namespaces/{ns}/batch/put", batch_body([block]), BATCH_MEDIA_TYPE),
        ("POST", f"/v1/namespaces/{ns}/lookup", b'{"keys": []}', "application/json"),
        ("GET", f"/v1/namespaces/{ns}/blocks/{block.key.hex()}", None, None),
        ("DELETE", f"/v1/namespaces/{ns}", None, None),
        ("GET", "/v1/stats", None, None),
        ("GET", "/metrics", None, None),
    ]:
        got, answer_headers, answer = call(
            url, method, path, body, content_type=ctype, headers=headers
        )
        assert got == status, (method, path, answer)
        assert b'"error"' in answer and b'"message"' in answer
        if status == 401:
            assert answer_headers["www-authenticate"] == "Bearer"
    # Nothing was stored by any of them.
    assert get_batch(url, ns, [block.key]) == [None]


def _answer_head(sock: socket.socket) -> bytes:
    """An answer's head, lowercased; its body (by Content-Length) is read and dropped."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    head = data.lower()
    length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
    while length:
        length -= len(sock.recv(length))
    return head


def test_a_refusal_before_the_body_says_the_connection_closes(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    port = int(shared_server.url.rsplit(":", 1)[1])
    body = b'{"keys": []}'
    head = (
        f"POST /v1/namespaces/{own_namespace.id}/lookup HTTP/1.1\r\nHost: x\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)  # the body only after the answer: the server never read it
        answer = _answer_head(sock)
        assert answer.startswith(b"http/1.1 401") and b"connection: close" in answer
        sock.sendall(body + head + body)  # dropped, not answered: the connection ends
        rest = b""
        while chunk := sock.recv(4096):
            rest += chunk
        assert b"http/1.1" not in rest.lower(), rest
    # The same refusal with the body in the same send: read whole, the connection stays.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(head + body)
            answer = _answer_head(sock)
            assert answer.startswith(b"http/1.1 401") and b"connection: close" not in answer


def test_the_right_tenant_claim_is_accepted(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    status, _ = call_json(
        shared_server.url,
        "POST",
        f"/v1/namespaces/{own_namespace.id}/lookup",
        {"keys": []},
        token=ALICE,
        headers={"X-Cachetier-Tenant": "alice"},
    )
    assert status == 200


def test_tenants_with_the_same_prompts_cannot_see_each_other(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    url, ns = shared_server.url, own_namespace.id
    # The same tokens under the same namespace give the same keys for both tenants.
    alice_blocks = make_blocks(own_namespace, 4, seed=1)
    bob_blocks = make_blocks(own_namespace, 4, seed=1)
    assert [b.key for b in alice_blocks] == [b.key for b in bob_blocks]
    put_batch(url, ns, alice_blocks[:3], token=ALICE)
    keys = [b.key for b in alice_blocks]
    never_stored = make_blocks(own_namespace, 4, seed=2)
    # Bob cannot read or detect them: every answer is the same as for keys nobody stored.
    for stored_keys, unstored_keys in [(keys, [b.key for b in never_stored])]:
        for what in ("lookup", "batch/exists"):
            path = f"/v1/namespaces/{ns}/{what}"
            seen = call(
                url, "POST", path, _keys(stored_keys), token=BOB, content_type="application/json"
            )
            fresh = call(
                url, "POST", path, _keys(unstored_keys), token=BOB, content_type="application/json"
            )
            assert seen[0] == fresh[0] == 200 and seen[2] == fresh[2]
        assert get_batch(url, ns, stored_keys, token=BOB) == [None] * 4
        head = f"/v1/namespaces/{ns}/blocks/{stored_keys[0].hex()}"
        assert call(url, "HEAD", head, token=BOB)[0] == 404
    # Bob's writes, deletes and clears land in his own storage only.
    overwrite = make_blocks(own_namespace, 1, seed=1)[0]
    bob_version = type(overwrite)(
        overwrite.key,
        overwrite.fingerprint,
        overwrite.dtype,
        overwrite.shape,
        16,
        make_blocks(own_namespace, 1, seed=7)[0].data,
    )
    assert put_batch(url, ns, [bob_version], token=BOB)[0] == 200
    assert call_json(url, "POST", f"/v1/namespaces/{ns}/batch/delete", _keys_obj(keys), token=BOB)[
        1
    ] == {"num_deleted": 1}
    assert call_json(url, "DELETE", f"/v1/namespaces/{ns}", token=BOB)[1] == {"num_deleted": 0}
    got = get_batch(url, ns, keys, token=ALICE)
    assert [bytes(g.data) for g in got[:3] if g] == [bytes(b.data) for b in alice_blocks[:3]]
    assert got[3] is None


@pytest.mark.parametrize(
    "namespace",
    ["t.alice.{ns}", "..", "{ns}/..", "..%2F{ns}", "t.alice", "alice", "%2e%2e"],
)
def test_namespace_games_never_reach_another_tenant(
    shared_server: ThreadServer, own_namespace: Namespace, namespace: str
) -> None:
    url, ns = shared_server.url, own_namespace.id
    blocks = make_blocks(own_namespace, 2)
    put_batch(url, ns, blocks, token=ALICE)
    target = namespace.format(ns=ns)
    status, _, body = call(
        url,
        "POST",
        f"/v1/namespaces/{target}/lookup",
        _keys([b.key for b in blocks]),
        token=BOB,
        content_type="application/json",
    )
    assert status in (200, 400, 404), body
    if status == 200:
        assert b'"num_blocks":0' in body
    status, _, body = call(
        url,
        "POST",
        f"/v1/namespaces/{target}/batch/get",
        _keys([b.key for b in blocks]),
        token=BOB,
        content_type="application/json",
    )
    assert status != 200 or body.count(b"CTKV") == 0


def test_a_record_cannot_be_planted_under_another_key(
    shared_server: ThreadServer, own_namespace: Namespace
) -> None:
    url, ns = shared_server.url, own_namespace.id
    wanted, forged = make_blocks(own_namespace, 2)
    path = f"/v1/namespaces/{ns}/blocks/{wanted.key.hex()}"
    status, _, body = call(
        url,
        "PUT",
        path,
        encode_record(forged),
        token=ALICE,
        content_type="application/octet-stream",
    )
    assert status == 400 and b"another key" in body
    assert call(url, "HEAD", path, token=ALICE)[0] == 404


def test_open_mode_accepts_no_token_and_says_so(
    make_server: Callable[..., ThreadServer],
    own_namespace: Namespace,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="cachetier.server"):
        server = make_server(open_mode=True, tenants={}, admin_tenants=())
    assert any("OPEN MODE" in r.getMessage() for r in caplog.records)
    blocks = make_blocks(own_namespace, 2)
    assert put_batch(server.url, own_namespace.id, blocks, token=None)[0] == 200
    assert all(get_batch(server.url, own_namespace.id, [b.key for b in blocks], token=None))
    assert call(server.url, "GET", "/v1/stats", token="wrong-token-0123456789")[0] == 401


def test_config_checks_tenants_and_tokens() -> None:
    with pytest.raises(ValueError, match="no tenants"):
        ServerConfig(tenants={})
    with pytest.raises(ValueError, match="at least 16"):
        ServerConfig(tenants={"alice": ["short"]})
    with pytest.raises(ValueError, match="tenant name"):
        ServerConfig(tenants={"al.ice": [ALICE]})
    with pytest.raises(ValueError, match="reserved"):
        ServerConfig(tenants={"open": [ALICE]})
    with pytest.raises(ValueError, match="one token is given to tenants"):
        ServerConfig(tenants={"alice": [ALICE], "bob": [ALICE]})
    with pytest.raises(ValueError, match="admin tenant"):
        ServerConfig(tenants={"alice": [ALICE]}, admin_tenants=("ops",))
    config = load_config(env={"CACHETIER_TENANTS": f"alice:{ALICE},bob:{BOB},alice:{BOB}x"})
    assert config.tenants == {"alice": (ALICE, BOB + "x"), "bob": (BOB,)}
    assert ALICE not in repr(config) and ALICE not in str(config.describe())


def _keys(keys: list[bytes]) -> bytes:
    return b'{"keys": [%s]}' % b",".join(b'"%s"' % k.hex().encode() for k in keys)


def _keys_obj(keys: list[bytes]) -> dict:
    return {"keys": [k.hex() for k in keys]}
