"""``--port 0 --ports-file``: servers started at once get ports of their own, and the ports file
is read whole or not at all. No test reserves a port by binding and closing it."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from pathlib import Path

import pytest

from cachetier.cli.ports import write_ports_file
from tests.server.live import ROOT, call, wait_healthy
from tests.support import end_process, spawn_serve, wait_ports_file


def test_two_servers_started_at_once_get_distinct_ports(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs, files = [], []
    for name in ("a", "b"):
        files.append(tmp_path / f"{name}.json")
        args = ["--open", "--port", "0", "--transfer-port", "0", "--ports-file", str(files[-1])]
        procs.append(spawn_serve([*args, "--data-dir", str(tmp_path / name)], env))
    try:
        ports = [wait_ports_file(path, proc) for path, proc in zip(files, procs, strict=True)]
        for path in files:
            assert json.loads(path.read_text()) == ports[files.index(path)]
        assert [sorted(p) for p in ports] == [["http", "transfer", "unix"]] * 2
        assert [p["unix"] for p in ports] == [None, None]
        numbers = [p[kind] for p in ports for kind in ("http", "transfer")]
        assert all(isinstance(n, int) and 0 < n < 65536 for n in numbers)
        assert len(set(numbers)) == 4, ports
        for p in ports:
            url = f"http://127.0.0.1:{p['http']}"
            wait_healthy(url)
            status, _, body = call(url, "GET", "/v1/limits")
            assert status == 200 and f'"transfer_port":{p["transfer"]}' in body.decode()
            socket.create_connection(("127.0.0.1", p["transfer"]), timeout=5).close()
    finally:
        printed = [end_process(proc)[1] for proc in procs]
    for p, err in zip(ports, printed, strict=True):
        assert f"listening on http {p['http']}, transfer {p['transfer']}" in err


def test_the_ports_file_names_the_unix_socket(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    path, sock = tmp_path / "ports.json", tmp_path / "transfer.sock"
    args = ["--open", "--port", "0", "--transfer-socket", str(sock), "--ports-file", str(path)]
    proc = spawn_serve([*args, "--data-dir", str(tmp_path / "data")], env)
    try:
        ports = wait_ports_file(path, proc)
        assert ports["transfer"] is None and ports["unix"] == str(sock)
        assert sock.is_socket()
    finally:
        end_process(proc)


def test_a_ports_file_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "ports.json"
    writes = [{"http": 1000 + i, "transfer": 2000 + i, "unix": "/x" * i} for i in range(300)]
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                seen.append(path.read_text())
            except FileNotFoundError:
                seen.append("")

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for ports in writes:
            write_ports_file(path, ports)
    finally:
        done.set()
        reader.join()
    # Each read found nothing or one of the files written, whole.
    assert all(text == "" or json.loads(text) in writes for text in seen)
    assert json.loads(path.read_text()) == writes[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ports.json"]  # no temporary left


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "ports.json"
    with pytest.raises(TypeError):
        write_ports_file(path, {"http": object()})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []
    write_ports_file(path, {"http": 1})
    with pytest.raises(TypeError):
        write_ports_file(path, {"http": object()})  # type: ignore[dict-item]
    assert json.loads(path.read_text()) == {"http": 1}  # the last whole file stays
    assert list(tmp_path.iterdir()) == [path]


def test_no_test_reserves_a_port_by_binding_and_closing_it() -> None:
    # benchmarks.support.children.free_port is for benchmarks only: a port closed again is
    # anyone's to take.
    callers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if path.name != "support.py" and re.search(r"\bfree_port\(", path.read_text())
    ]
    assert callers == []
