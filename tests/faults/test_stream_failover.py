"""A replica SIGKILLed under streamed chats: 20 streams through a real router to two real engine
servers of the tiny model (the one killed is a child process), killed while it runs some of its
streams and queues the rest. A stream that had no token yet is retried on the other replica and
completes; one cut after its first token ends with an error event and [DONE]. None ends in
silence: the figure ``streams_cut_silently_with_replica_killed``."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cachetier.router.app import RouteDecision, create_app
from cachetier.router.config import RouterConfig
from cachetier.router.replicas import Replica
from tests.engine.server.live import EngineServer, chat_model, metric, server_config
from tests.faults.conftest import FaultFigures
from tests.server.live import wait_healthy
from tests.support import AppThread, end_process, wait_ports_file

ROOT = Path(__file__).resolve().parents[2]
NUM_STREAMS = 20
MAX_TOKENS = 120
PROMPT_CHARS = 1500  # byte tokenizer: a token a byte, a prefill that takes a step of its own
MAX_NUM_SEQS = 4  # per replica: the rest of its streams wait, tokenless, in its queue


class EngineProcess:
    """``python -m cachetier.engine.server`` of ``model`` in a child process, on port 0."""

    def __init__(self, model: Path, folder: Path) -> None:
        self.ports_file = folder / "ports.json"
        args = [
            *("--model", str(model), "--served-model-name", "tiny", "--cpu-bytes", "0"),
            *("--port", "0", "--ports-file", str(self.ports_file), "--num-threads", "1"),
            *("--kv-cache-bytes", str(16 << 20), "--max-num-seqs", str(MAX_NUM_SEQS)),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETIER_")}
        # Its log goes to a file: a pipe nobody reads would fill and stall the server.
        with open(folder / "engine.log", "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cachetier.engine.server", *args],
                cwd=ROOT,
                env={**env, "PYTHONPATH": str(ROOT)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = ""

    def wait_ready(self) -> str:
        port = wait_ports_file(self.ports_file, self.proc, timeout_s=120)["http"]
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.url, timeout_s=120, proc=self.proc)
        return self.url


def least_loaded(
    tokens: list[int] | None, session: str | None, up: Sequence[Replica]
) -> RouteDecision:
    """The replicas by the streams the router has open to each: the chats split evenly."""
    return RouteDecision(sorted(up, key=lambda r: r.in_flight))


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, EngineProcess, EngineServer]]:
    """The victim, a child process to SIGKILL, and the survivor, a server in this process
    (started while the child loads: half the start-up of two processes)."""
    folder = tmp_path_factory.mktemp("stream-failover")
    model = chat_model(tiny_model_dir, folder / "tiny")
    victim = EngineProcess(model, folder)
    try:
        engine_args = {"kv_cache_bytes": 16 << 20, "max_num_seqs": MAX_NUM_SEQS}
        survivor = EngineServer(server_config(model, engine_args=engine_args)).start()
        try:
            victim.wait_ready()
            yield model, victim, survivor
        finally:
            survivor.stop()
    finally:
        end_process(victim.proc, signal.SIGKILL)


def _read_stream(url: str, index: int) -> str:
    """One streamed chat, read to its end: ``complete``, ``error``, ``cut`` or ``status N``."""
    host, port = url.removeprefix("http://").split(":")
    content = f"{index:03d} " + "".join(chr(97 + (index * i) % 26) for i in range(PROMPT_CHARS))
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body))
        resp = conn.getresponse()
        if resp.status != 200:
            return f"status {resp.status}: {resp.read()[:300]!r}"
        events = list(_events(resp))
    finally:
        conn.close()
    if any(isinstance(e, dict) and "error" in e for e in events):
        return "error"
    finished = any(isinstance(e, dict) and e["choices"][0]["finish_reason"] for e in events)
    return "complete" if finished and events[-1] == "[DONE]" else "cut"


def _events(resp: http.client.HTTPResponse) -> Iterator[Any]:
    """The stream's events until it ends, however it ends (a broken chunked body included)."""
    try:
        while line := resp.readline():
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                yield data if data == "[DONE]" else json.loads(data)
    except (http.client.IncompleteRead, OSError, ValueError):
        return  # a cut body: what comes after it is the stream's end, as a client sees it


def _kill_when_busy(victim: EngineProcess, ends: list[Future[str]]) -> None:
    """SIGKILL ``victim`` once it generates for some streams and queues others."""

    def seen() -> tuple[float, float, float]:
        return (
            metric(victim.url, "cachetier_engine_num_requests_running"),
            metric(victim.url, "cachetier_engine_num_requests_waiting"),
            metric(victim.url, "cachetier_engine_generation_tokens_total"),
        )

    deadline = time.monotonic() + 120
    while not ((now := seen())[0] >= 1 and now[1] >= 1 and now[2] >= 2 * MAX_NUM_SEQS):
        assert time.monotonic() < deadline, f"never running and queued: {now}"
        if all(end.done() for end in ends):
            return  # every stream ended before: the outcomes say how
        time.sleep(0.01)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=30)


def test_no_stream_is_cut_silently_when_a_replica_is_killed(
    engines: tuple[Path, EngineProcess, EngineServer], fault_figures: FaultFigures
) -> None:
    model, victim, survivor = engines
    config = RouterConfig(
        (victim.url, survivor.url), model=str(model), port=0, max_queued_prepares=NUM_STREAMS
    )
    router = AppThread(lambda: create_app(config, least_loaded), name="router")
    router.start_thread()
    try:
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            ends = [pool.submit(_read_stream, router.url, i) for i in range(NUM_STREAMS)]
            _kill_when_busy(victim, ends)
            outcomes = [end.result(timeout=300) for end in ends]
        retries = metric(router.url, "cachetier_router_retries_total")
    finally:
        router.stop()
    num_cut = outcomes.count("cut")
    fault_figures.set("streams_cut_silently_with_replica_killed", num_cut)
    assert num_cut == 0, outcomes
    assert set(outcomes) <= {"complete", "error"}, outcomes
    # The kill hit streams mid-answer (they end with an error event) and streams still
    # waiting for their first token (retried on the survivor, and complete).
    assert outcomes.count("error") >= 1 and retries >= 1, (outcomes, retries)
    assert outcomes.count("complete") >= retries, (outcomes, retries)
