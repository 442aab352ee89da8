"""The sidecar's KV events beyond loopback: bound on every address with CURVE keys, a block put
over HTTP reaches a reader with a listed key, and a reader with no keys or an unlisted pair
gets nothing; without keys such a bind is a bad configuration."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from cachetier.cli.kv_events_keys import write_keys
from cachetier.kvevents import KVEventPublisher
from cachetier.primitives.keys import Namespace
from tests.cachetier.kvevents.curve_reads import intruder_messages, listed_stored_keys
from tests.server.batches import put_batch
from tests.server.live import ThreadServer, test_config
from tests.support import make_blocks


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sidecar-kv-events") / "keys"
    write_keys(folder, ["router"])
    return folder


@pytest.fixture(scope="module")
def sidecar(keys: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    config = test_config(
        tmp_path_factory.mktemp("sidecar-kv-events-data"),
        kv_events="tcp://0.0.0.0:0",
        kv_events_replay="tcp://0.0.0.0:0",
        kv_events_curve_key=str(keys / "publisher.key_secret"),
        kv_events_curve_clients=str(keys / "clients"),
    )
    server = ThreadServer(config).start()
    yield server
    server.stop()


def _publisher(server: ThreadServer) -> KVEventPublisher:
    # Where port 0 became: the service the lifespan built holds the publisher.
    publisher = server._server.lifespan.state["service"].publisher
    assert publisher is not None and publisher.endpoint.startswith("tcp://0.0.0.0:")
    return publisher


def test_a_listed_reader_gets_the_sidecars_blocks_and_no_one_else(
    sidecar: ThreadServer, keys: Path, own_namespace: Namespace, tmp_path: Path
) -> None:
    blocks = make_blocks(own_namespace, 3)
    status, _ = put_batch(sidecar.url, own_namespace.id, blocks)
    assert status == 200
    publisher = _publisher(sidecar)
    endpoint, replay, server = publisher.endpoint, publisher.replay_endpoint, keys / "publisher.key"
    _, mallory = zmq.auth.create_certificates(tmp_path, "mallory")
    for secret in (None, Path(mallory)):
        got = intruder_messages(endpoint, replay, server, secret)
        assert got == 0, f"{secret}: {got} messages"
    put = {bytes(b.key) for b in blocks}
    secret = keys / "router.key_secret"
    assert put <= listed_stored_keys(endpoint, replay, secret, server, put)


def test_a_bind_beyond_loopback_without_keys_is_refused(tmp_path: Path, keys: Path) -> None:
    with pytest.raises(ValueError, match="beyond loopback.*kv_events_curve_key"):
        test_config(tmp_path, kv_events="tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="go together"):
        test_config(
            tmp_path, kv_events="tcp://0.0.0.0:0", kv_events_curve_clients=str(keys / "clients")
        )
    with pytest.raises(ValueError, match="need kv_events"):
        test_config(tmp_path, kv_events_curve_key=str(keys / "publisher.key_secret"))
