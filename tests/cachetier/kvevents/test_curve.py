"""CURVE settings: key files that are missing, public where a secret is needed, or a folder
with no certificate are refused with a message (and the authenticator thread stopped)."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq.auth

from cachetier.kvevents import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherConfig,
    SubscriberConfig,
)


@pytest.fixture
def cert(tmp_path: Path) -> tuple[str, str]:
    public, secret = zmq.auth.create_certificates(tmp_path, "a")
    return str(public), str(secret)


@pytest.mark.parametrize("which", ["missing", "public"])
def test_a_publisher_with_an_unusable_key_file_is_refused(
    cert: tuple[str, str], tmp_path: Path, which: str
) -> None:
    key = str(tmp_path / "nope") if which == "missing" else cert[0]
    config = PublisherConfig("r", curve_secret_key_file=key, curve_public_keys_dir=str(tmp_path))
    with pytest.raises(ValueError, match="CURVE key file"):
        KVEventPublisher(config)


def test_a_folder_without_certificates_is_refused(cert: tuple[str, str], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    config = PublisherConfig("r", curve_secret_key_file=cert[1], curve_public_keys_dir=str(empty))
    with pytest.raises(ValueError, match="holds no"):
        KVEventPublisher(config)


def test_a_subscriber_needs_its_secret_key(cert: tuple[str, str]) -> None:
    config = SubscriberConfig(
        "tcp://127.0.0.1:1", curve_secret_key_file=cert[0], curve_server_key_file=cert[0]
    )
    with pytest.raises(ValueError, match="secret"):
        KVEventSubscriber(config)
    with pytest.raises(ValueError, match="go together"):
        SubscriberConfig("tcp://127.0.0.1:1", curve_secret_key_file=cert[1])
