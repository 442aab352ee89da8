"""A noisy tenant in a process of its own: alice sends lookups as fast as ``--connections``
HTTP connections and one transfer connection allow, until its stdin closes, then prints the
answers it got (status -> count) as one JSON line.

A process of its own, at a lower CPU priority: on the pod network the flooding client runs on
another machine, so neither its interpreter lock nor its CPU should be the victim's or the
server's here.

    python -m tests.faults.noisy_tenant --port P --transfer-port T --connections 24
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import threading

from tests.server.live import TOKENS

NAMESPACE = "fairness-noisy"
NICE = 10  # below the server and the victim


class Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answers: dict[str, int] = {}

    def add(self, what: str) -> None:
        with self.lock:
            self.answers[what] = self.answers.get(what, 0) + 1


def read_exactly(sock: socket.socket, nbytes: int) -> bytes | None:
    out = b""
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        if not chunk:
            return None
        out += chunk
    return out


def flood_http(port: int, stop: threading.Event, counts: Counts) -> None:
    body = json.dumps({"keys": ["00" * 32]}).encode()
    headers = {"Authorization": f"Bearer {TOKENS['alice']}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    while not stop.is_set():
        try:
            conn.request("POST", f"/v1/namespaces/{NAMESPACE}/lookup", body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            counts.add(f"http_{resp.status}")
        except (OSError, http.client.HTTPException):
            counts.add("http_error")
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.close()


def flood_transfer(port: int, stop: threading.Event, counts: Counts) -> None:
    from cachetier.protocol.transfer_frames import REPLY, Op, Status, hello, request

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(hello(TOKENS["alice"], None))
        head = read_exactly(sock, REPLY.size)
        if head is None or REPLY.unpack(head)[0] != Status.OK:
            counts.add("transfer_refused")
            return
        while not stop.is_set():
            sock.sendall(request(Op.GET, NAMESPACE, 1) + b"\0" * 32)
            head = read_exactly(sock, REPLY.size)
            if head is None:
                counts.add("transfer_closed")
                return
            status, value = REPLY.unpack(head)
            read_exactly(sock, 8 * value if status == Status.OK else value)
            counts.add(f"transfer_{Status(status).name.lower()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--transfer-port", type=int, default=0)
    parser.add_argument("--connections", type=int, default=24)
    args = parser.parse_args()
    os.nice(NICE)
    stop, counts = threading.Event(), Counts()
    threads = [
        threading.Thread(target=flood_http, args=(args.port, stop, counts))
        for _ in range(args.connections)
    ]
    if args.transfer_port:
        threads.append(
            threading.Thread(target=flood_transfer, args=(args.transfer_port, stop, counts))
        )
    for thread in threads:
        thread.start()
    print("flooding", flush=True)
    sys.stdin.read()  # until the test closes it
    stop.set()
    for thread in threads:
        thread.join(30)
    print(json.dumps(counts.answers), flush=True)


if __name__ == "__main__":
    main()
