"""``cachetier kv-events-keys``: the certificates it writes let the router read a real CURVE
publisher, and nobody else (no keys, or a key pair it did not list); secrets are 0600 and no
file is ever overwritten."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq.auth

from cachetier.cli.kv_events_keys import write_keys
from cachetier.cli.main import main
from cachetier.kvevents import BlockStored, KVEventPublisher, PublisherConfig
from tests.cachetier.kvevents.curve_reads import intruder_messages, listed_stored_keys
from tests.cachetier.kvevents.streams import random_keys


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("kv-events-keys") / "keys"
    assert main(["kv-events-keys", str(folder), "--clients", "router", "indexer"]) == 0
    return folder


@pytest.fixture(scope="module")
def publisher(keys: Path) -> Iterator[KVEventPublisher]:
    config = PublisherConfig(
        "pod-a",
        endpoint="tcp://0.0.0.0:0",  # beyond loopback: allowed with the keys alone
        replay_endpoint="tcp://0.0.0.0:0",
        heartbeat_s=0.05,
        curve_secret_key_file=str(keys / "publisher.key_secret"),
        curve_public_keys_dir=str(keys / "clients"),
    )
    with KVEventPublisher(config, epoch=1) as pub:
        yield pub


def test_it_writes_a_pair_per_name_with_private_secrets(keys: Path) -> None:
    names = {p.relative_to(keys).as_posix() for p in keys.rglob("*") if p.is_file()}
    pairs = {f"{n}.key{s}" for n in ("publisher", "router", "indexer") for s in ("", "_secret")}
    assert names == pairs | {"clients/router.key", "clients/indexer.key"}
    for path in keys.rglob("*.key_secret"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert zmq.auth.load_certificate(path)[1] is not None
    assert stat.S_IMODE((keys / "clients").stat().st_mode) == 0o700


def test_its_keys_let_the_router_read_and_nobody_else(
    keys: Path, publisher: KVEventPublisher, tmp_path: Path
) -> None:
    stored = {bytes(k) for k in random_keys(4)}
    assert publisher.publish([BlockStored(tuple(stored), None, (), 16, "GPU")])
    server = keys / "publisher.key"
    _, mallory = zmq.auth.create_certificates(tmp_path, "mallory")
    for secret in (None, Path(mallory)):
        got = intruder_messages(publisher.endpoint, publisher.replay_endpoint, server, secret)
        assert got == 0, f"{secret}: {got} messages"
    # Each listed reader replays the history and finds the blocks.
    for name in ("router", "indexer"):
        secret = keys / f"{name}.key_secret"
        seen = listed_stored_keys(
            publisher.endpoint, publisher.replay_endpoint, secret, server, stored
        )
        assert stored <= seen, name


def test_it_never_overwrites_a_file(keys: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: p.read_bytes() for p in keys.rglob("*") if p.is_file()}
    assert main(["kv-events-keys", str(keys)]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in keys.rglob("*") if p.is_file()} == before
    # A name of its own, or a new reader's pair: refused as long as any of its files exists.
    with pytest.raises(FileExistsError):
        write_keys(keys, ["newcomer"])
    assert not (keys / "newcomer.key").exists() and not any(keys.glob(".kv-events-keys-*"))


def test_bad_names_are_refused(tmp_path: Path) -> None:
    for names in (["publisher"], ["a/b"], ["r", "r"], [""]):
        assert main(["kv-events-keys", str(tmp_path / "k"), "--clients", *names]) == 2, names
    assert not (tmp_path / "k").exists()
