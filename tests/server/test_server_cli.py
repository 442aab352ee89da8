"""``cachetier serve`` as a real child process: config from a file and the environment, printed
at start with tokens hidden; SIGTERM flushes and exits; blocks on disk survive a restart."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from cachetier.primitives.keys import Namespace
from cachetier.tiers.remote import RemoteTier
from tests.server.live import ROOT, TOKENS, ProcessServer, call
from tests.support import make_blocks


def test_serve_reads_file_and_env_and_survives_a_restart(
    tmp_path: Path, make_remote: Callable[..., RemoteTier], namespace: Namespace
) -> None:
    config = tmp_path / "cachetier.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "data"}"\n'
        "fsync = false\n"
        "cpu_bytes = 1048576\n"
        'log_level = "info"\n'
        "[tenants]\n"
        f'alice = ["{TOKENS["alice"]}"]\n'
    )
    # The environment wins over the file: bob's token comes from there.
    env = {"CACHETIER_TENANTS": f"bob:{TOKENS['bob']}", "CACHETIER_MAX_BATCH_BLOCKS": "8"}
    server = ProcessServer(["--config", str(config)], env).start()
    tier = make_remote(server.url, token_of="bob")
    blocks = make_blocks(namespace, 12)
    assert tier.put_many(namespace.id, blocks) == 12  # in batches of 8: the server says so
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: the status says SIGTERM.
    assert server.stop() in (0, -signal.SIGTERM)
    printed = server.stderr
    assert '"max_batch_blocks": 8' in printed and '"bob": "1 token(s)"' in printed
    assert TOKENS["bob"] not in printed and TOKENS["alice"] not in printed
    assert "store flushed and closed" in printed
    assert (tmp_path / "data" / "blocks" / f"t.bob.{namespace.id}").is_dir()

    server.start()
    try:
        got = tier.get_many(namespace.id, [b.key for b in blocks])
        assert [bytes(g.data) for g in got if g] == [bytes(b.data) for b in blocks]
        alice = call(server.url, "GET", "/v1/stats", token=TOKENS["alice"])[0]
        assert alice == 401  # the environment's tenants replaced the file's
    finally:
        server.stop(signal.SIGINT)


def test_open_mode_is_announced_loudly(tmp_path: Path) -> None:
    server = ProcessServer(["--open", "--data-dir", str(tmp_path)], {}).start()
    try:
        assert call(server.url, "GET", "/v1/stats")[0] == 200
    finally:
        server.stop()
    assert "OPEN MODE" in server.stderr and "!!!!!!!!" in server.stderr


def test_a_bad_config_exits_with_a_message(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cachetier.cli.main", "serve", "--data-dir", str(tmp_path)],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no tenants are configured" in done.stderr


def test_redis_bytes_without_a_redis_is_a_bad_config(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cachetier.cli.main", "serve", "--open", "--redis-bytes", "1048576"]
        + ["--data-dir", str(tmp_path)],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "redis_bytes is set without redis_url" in done.stderr
