"""The server's config and command line: validation, tiers from CACHETIER_* and flags, and a
real ``python -m cachetier.engine.server`` process that prints its config and pool and flushes
on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cachetier.engine.server.__main__ import server_config
from cachetier.engine.server.config import EngineServerConfig
from cachetier.report.events import read_events
from cachetier.store.config import StoreConfig
from tests.engine.server.live import post
from tests.server.live import ROOT, wait_healthy
from tests.support import wait_ports_file


def test_config_checks_its_values() -> None:
    assert EngineServerConfig().model_name == "SmolLM2-135M-Instruct"
    assert EngineServerConfig(model="/models/my-llama").model_name == "my-llama"
    assert EngineServerConfig(served_model_name="x").model_name == "x"
    with pytest.raises(ValueError, match="unknown engine_args"):
        EngineServerConfig(engine_args={"kv_bytes": 1})
    with pytest.raises(ValueError, match="block_size"):
        EngineServerConfig(engine_args={"block_size": 3})
    with pytest.raises(ValueError, match="port"):
        EngineServerConfig(port=70000)
    with pytest.raises(ValueError, match="api_key"):
        EngineServerConfig(api_key="")
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        EngineServerConfig(max_concurrent_requests=0)
    config = EngineServerConfig(engine_args={"block_size": 32})
    with pytest.raises(TypeError):
        config.engine_args["block_size"] = 16  # type: ignore[index]
    assert "secret" not in repr(EngineServerConfig(api_key="secret"))
    with pytest.raises(ValueError, match="kv_events_queue"):
        EngineServerConfig(kv_events_queue=0)
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        EngineServerConfig(kv_events_endpoint="http://127.0.0.1:5557")


def test_kv_events_flags() -> None:
    argv = ["--kv-events", "--kv-events-queue", "8", "--kv-events-endpoint", "tcp://0.0.0.0:5557"]
    argv += ["--kv-events-replay-endpoint", "tcp://0.0.0.0:5558"]
    config, _ = server_config(argv, {})
    assert config.kv_events and config.kv_events_queue == 8
    assert config.kv_events_endpoint == "tcp://0.0.0.0:5557"
    assert config.kv_events_replay_endpoint == "tcp://0.0.0.0:5558"


def test_tiers_come_from_the_environment_and_flags_win() -> None:
    env = {"CACHETIER_DISK_PATH": "/tmp/kv-env", "CACHETIER_CPU_BYTES": "1024"}
    config, _ = server_config(["--port", "0"], env)
    assert config.store == StoreConfig(cpu_bytes=1024, disk_path="/tmp/kv-env")
    config, _ = server_config(["--disk-path", "/tmp/kv-flag", "--cpu-bytes", "0"], env)
    assert config.store == StoreConfig(cpu_bytes=0, disk_path="/tmp/kv-flag")
    config, _ = server_config(["--cpu-bytes", "0"], {})
    assert config.store is None
    config, timeout = server_config(["--event-log", "/tmp/e.jsonl", "--graceful-timeout", "5"], {})
    assert config.engine_args["event_log"] == "/tmp/e.jsonl" and timeout == 5
    with pytest.raises(SystemExit):
        server_config(["--block-size", "3"], {})
    assert server_config([], {})[0].engine_args["kv_load_policy"] == "cost"


def test_every_store_setting_has_its_flag_and_a_bad_value_names_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--disk-path", "/tmp/kv", "--redis-timeout-s", "0.5", "--no-fsync", "--policy", "lru"]
    config, _ = server_config(argv, {})
    assert config.store == StoreConfig(
        disk_path="/tmp/kv", redis_timeout_s=0.5, fsync=False, policy="lru"
    )
    with pytest.raises(SystemExit):
        server_config(["--disk-path", "/tmp/kv", "--write-queue-blocks", "many"], {})
    assert "--write-queue-blocks" in capsys.readouterr().err
    config, _ = server_config(["--kv-load-policy", "always"], {})
    assert config.engine_args["kv_load_policy"] == "always"
    with pytest.raises(SystemExit):
        server_config(["--kv-load-policy", "never"], {})


@pytest.mark.slow(
    reason="starts the engine server as a child process and waits for its SIGTERM flush"
)
def test_the_command_line_server_flushes_on_sigterm(chat_model_dir: Path, tmp_path: Path) -> None:
    disk, log = tmp_path / "disk", tmp_path / "lookups.jsonl"
    ports_file = tmp_path / "ports.json"
    args = [
        "--model",
        str(chat_model_dir),
        "--port",
        "0",
        "--ports-file",
        str(ports_file),
        "--served-model-name",
        "tiny",
        "--kv-cache-bytes",
        str(4 << 20),
        "--cpu-bytes",
        "0",
        "--disk-path",
        str(disk),
        "--event-log",
        str(log),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHETIER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachetier.engine.server", *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = wait_ports_file(ports_file, proc, timeout_s=120)["http"]
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=120, proc=proc)
        body = {"prompt": [(i * 3) % 250 for i in range(40)], "max_tokens": 4}
        status, answer = post(f"http://127.0.0.1:{port}", "/v1/completions", body)
        assert status == 200, answer
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "Application shutdown complete" in err
    assert "engine server config: EngineServerConfig(" in err
    assert f"engine server: listening on http {port}" in err
    assert "KV pool of" in err and "tiers ['disk']" in err
    assert "store flushed and closed" in err
    assert len([p for p in disk.rglob("*") if p.is_file()]) >= 2  # 2 full blocks of 40 tokens
    assert [e.num_tokens for e in read_events(log, strict=True)] == [40]
