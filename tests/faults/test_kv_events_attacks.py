"""Attacks on the KV-event sockets, with real sockets on 127.0.0.1.

- A reader without the right CURVE keys (none, or a key pair that is not listed) connects to
  the PUB and the replay socket of a publisher whose events carry a prompt: it must receive
  nothing, while a listed reader receives the prompt's events (the attack can succeed).
- 100 replay clients that ask for the whole buffer again and again and never read: the
  publisher's memory (a process of its own) must stay bounded, and its live stream alive.
- A bind beyond loopback without keys is refused.

Figures: ``kv_events_unauthenticated_reads`` (messages the unlisted readers received) and
``replay_clients_rss_growth_mib`` (the publisher's VmRSS growth under the replay flood).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from cachetier.kvevents import (
    BlockStored,
    KVEventPublisher,
    KVEventSubscriber,
    PublisherConfig,
    SubscriberConfig,
)
from cachetier.kvevents.framing import encode_replay_request
from cachetier.primitives.keys import chain_keys
from tests.faults.conftest import FaultFigures

PROMPT = list(range(1000, 2200))  # 1,200 token ids, as in the issue
NUM_REPLAY_CLIENTS = 100
LISTEN_S = 1.5


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Certificates: the publisher's, the router's (listed), mallory's (not listed)."""
    root = tmp_path_factory.mktemp("curve")
    allowed = root / "allowed"
    allowed.mkdir()
    out: dict[str, Path] = {}
    for name in ("publisher", "router", "mallory"):
        public, secret = zmq.auth.create_certificates(root, name)
        out[name], out[f"{name}_secret"] = Path(public), Path(secret)
    (allowed / "router.key").write_bytes(out["router"].read_bytes())
    out["allowed"] = allowed
    return out


@pytest.fixture(scope="module")
def curve_publisher(keys: dict[str, Path]) -> Iterator[KVEventPublisher]:
    config = PublisherConfig(
        "pod-a",
        heartbeat_s=0.05,
        curve_secret_key_file=str(keys["publisher_secret"]),
        curve_public_keys_dir=str(keys["allowed"]),
    )
    publisher = KVEventPublisher(config, epoch=1)
    keys_chain = chain_keys(b"\x03" * 32, 16, PROMPT)
    assert publisher.publish([BlockStored(tuple(keys_chain), None, tuple(PROMPT), 16, "GPU")])
    yield publisher
    publisher.close()


def _listen(sock: zmq.Socket, seconds: float) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            got.append(sock.recv_multipart())
    return got


def _intruders(ctx: zmq.Context, publisher: KVEventPublisher, keys: dict[str, Path]) -> list:
    """A SUB and a replay DEALER with no keys, and the same with mallory's (unlisted) keys."""
    socks = []
    for curve in (False, True):
        sub = ctx.socket(zmq.SUB)
        dealer = ctx.socket(zmq.DEALER)
        for sock in (sub, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            if curve:
                public, secret = zmq.auth.load_certificate(keys["mallory_secret"])
                sock.curve_publickey, sock.curve_secretkey = public, secret
                sock.curve_serverkey = zmq.auth.load_certificate(keys["publisher"])[0]
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart(encode_replay_request(0))  # the whole history
        socks += [sub, dealer]
    return socks


def test_readers_without_listed_keys_get_nothing_and_a_listed_one_gets_the_prompt(
    curve_publisher: KVEventPublisher, keys: dict[str, Path], fault_figures: FaultFigures
) -> None:
    ctx = zmq.Context()
    socks = _intruders(ctx, curve_publisher, keys)
    try:
        received = sum(len(_listen(sock, LISTEN_S / len(socks))) for sock in socks)
        received += sum(len(_listen(sock, 0.2)) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
    fault_figures.set("kv_events_unauthenticated_reads", received)
    assert received == 0, f"readers without listed keys received {received} messages"

    # The listed reader replays from 0 and finds the prompt's tokens.
    config = SubscriberConfig(
        curve_publisher.endpoint,
        curve_publisher.replay_endpoint,
        curve_secret_key_file=str(keys["router_secret"]),
        curve_server_key_file=str(keys["publisher"]),
    )
    with KVEventSubscriber(config) as sub:
        tokens: list[int] = []
        deadline = time.monotonic() + 5
        while not tokens and time.monotonic() < deadline:
            for d in sub.receive(timeout_s=0.2):
                tokens += [t for e in d.batch.events for t in getattr(e, "token_ids", ())]
    assert tokens == PROMPT


def test_a_bind_beyond_loopback_needs_keys_or_an_explicit_setting() -> None:
    with pytest.raises(ValueError, match="beyond loopback"):
        PublisherConfig("pod-a", endpoint="tcp://0.0.0.0:0")
    with pytest.raises(ValueError, match="beyond loopback"):
        PublisherConfig("pod-a", replay_endpoint="tcp://10.0.0.1:0")
    with pytest.raises(ValueError, match="go together"):
        PublisherConfig("pod-a", curve_secret_key_file="/x")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/<pid>/status")


def _settled_rss(pid: int, seconds: float) -> float:
    """The highest VmRSS seen over ``seconds``."""
    peak = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.05)
    return peak


def test_replay_clients_that_never_read_cost_the_publisher_bounded_memory(
    fault_figures: FaultFigures,
) -> None:
    settings = {"replica": "pod-a", "heartbeat_s": 0.05, "num_batches": 2000}
    settings["tokens_per_batch"] = 1200
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.kv_events_publisher", json.dumps(settings)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context()
    clients: list[zmq.Socket] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        where = json.loads(child.stdout.readline())
        before = _settled_rss(child.pid, 0.5)
        for _ in range(NUM_REPLAY_CLIENTS):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 1)  # it never reads: let nothing drain
            dealer.setsockopt(zmq.RCVBUF, 4096)
            dealer.connect(where["replay_endpoint"])
            clients.append(dealer)
        for _ in range(20):  # ask again and again for the whole buffer
            for dealer in clients:
                dealer.send_multipart(encode_replay_request(0), zmq.NOBLOCK)
        growth = _settled_rss(child.pid, 3.0) - before
        fault_figures.set("replay_clients_rss_growth_mib", round(growth, 1))
        assert growth <= 64, f"the publisher grew {growth:.0f} MiB"

        # The live stream is alive: a subscriber still gets heartbeats.
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(where["endpoint"])
        alive = bool(sub.poll(5000))
        sub.close()
        assert alive, "no heartbeat after the flood"
    finally:
        for dealer in clients:
            dealer.close()
        ctx.term()
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
    stats = json.loads(child.stdout.readline()) if child.stdout else {}
    assert stats.get("num_replay_clients_refused", 0) > 0, "the client cap did not engage"
