"""Reading a CURVE publisher as a listed reader and as intruders, over real sockets: what the
tests of the key-making command and of the sidecar's keyed events share."""

from __future__ import annotations

import time
from pathlib import Path

import zmq
import zmq.auth

from cachetier.kvevents import BlockStored, KVEventSubscriber, SubscriberConfig
from cachetier.kvevents.framing import encode_replay_request

LISTEN_S = 1.0
WAIT_S = 5.0


def dialable(endpoint: str) -> str:
    """A wildcard bind's endpoint as a client on this host dials it."""
    return endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


def listed_stored_keys(
    endpoint: str, replay: str | None, secret: Path, server: Path, until: set[bytes]
) -> set[bytes]:
    """The keys of ``BlockStored`` events a ``KVEventSubscriber`` with these certificates
    receives (replaying from the start) until it has seen every key of ``until``, or ``WAIT_S``
    has passed."""
    config = SubscriberConfig(
        dialable(endpoint),
        None if replay is None else dialable(replay),
        curve_secret_key_file=str(secret),
        curve_server_key_file=str(server),
    )
    seen: set[bytes] = set()
    with KVEventSubscriber(config) as sub:
        deadline = time.monotonic() + WAIT_S
        while not until <= seen and time.monotonic() < deadline:
            for delivery in sub.receive(timeout_s=0.1):
                for event in delivery.batch.events:
                    if isinstance(event, BlockStored):
                        seen.update(bytes(k) for k in event.block_hashes)
    return seen


def intruder_messages(endpoint: str, replay: str | None, server: Path, secret: Path | None) -> int:
    """Messages a SUB and a replay DEALER (asking for the whole history) receive within
    ``LISTEN_S``, with no CURVE at all (``secret`` ``None``) or as the key pair in ``secret``."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.SUB)] + ([ctx.socket(zmq.DEALER)] if replay is not None else [])
    try:
        for sock in socks:
            sock.setsockopt(zmq.LINGER, 0)
            if secret is not None:
                sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(secret)
                sock.curve_serverkey = zmq.auth.load_certificate(server)[0]
        socks[0].setsockopt(zmq.SUBSCRIBE, b"")
        socks[0].connect(dialable(endpoint))
        if replay is not None:
            socks[1].connect(dialable(replay))
            socks[1].send_multipart(encode_replay_request(0))
        received = 0
        deadline = time.monotonic() + LISTEN_S
        while (left := deadline - time.monotonic()) > 0:
            for sock in socks:
                if sock.poll(max(1, int(left * 1000) // len(socks))):
                    sock.recv_multipart()
                    received += 1
        return received
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
