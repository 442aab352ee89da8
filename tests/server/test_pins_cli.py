"""``cachetier pin``, ``unpin`` and ``pins`` against a live sidecar, as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from cachetier.primitives.keys import Namespace, block_keys
from tests.server.batches import put_batch
from tests.server.live import ROOT, TOKENS, ThreadServer, call_json
from tests.support import make_blocks


def _cli(*args: str, token: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CACHETIER_REMOTE_TOKEN"}
    env["PYTHONPATH"] = str(ROOT)
    if token is not None:
        env["CACHETIER_REMOTE_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "cachetier.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pin_pins_and_unpin_from_the_command_line(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace, tmp_path
) -> None:
    server = make_server()
    alice = TOKENS["alice"]
    tokens = list(range(40, 40 + 3 * own_namespace.block_size))
    (tmp_path / "prompt.ids").write_text(",".join(map(str, tokens)))
    keys = block_keys(own_namespace, tokens)
    common = ["--url", server.url, "--namespace", own_namespace.id]
    done = _cli(
        "pin",
        *common,
        "--token-ids",
        f"@{tmp_path / 'prompt.ids'}",
        "--block-size",
        "16",
        token=alice,
    )
    assert done.returncode == 0, done.stderr
    assert "pinned 3 block(s)" in done.stdout and "(3 new)" in done.stdout
    assert alice not in done.stdout + done.stderr  # the token is sent, never shown
    listed = _cli("pins", "--url", server.url, token=TOKENS["ops"])
    assert listed.returncode == 0, listed.stderr
    assert f"alice/{own_namespace.id}: 3 pinned key(s)" in listed.stdout
    assert "tier disk: 0 block(s)" in listed.stdout  # pinned before the blocks arrive
    blocks = make_blocks(own_namespace, 2)
    put_batch(server.url, own_namespace.id, blocks)
    done = _cli("pin", *common, "--keys", *[b.key.hex() for b in blocks], "--json", token=alice)
    assert done.returncode == 0 and '"num_new": 2' in done.stdout
    done = _cli("unpin", *common, "--keys", keys[0].hex(), token=alice)
    assert done.returncode == 0 and "unpinned 1 block(s)" in done.stdout
    _, mine = call_json(server.url, "GET", "/v1/pins", token=alice)
    assert len(mine["pins"][0]["keys"]) == 4


def test_pin_refusals_are_one_line_and_exit_1_or_2(
    make_server: Callable[..., ThreadServer], own_namespace: Namespace
) -> None:
    server = make_server()
    common = ["--url", server.url, "--namespace", own_namespace.id, "--keys", "ab" * 32]
    done = _cli("pin", *common, token=None)
    assert done.returncode == 1 and "401" in done.stderr and "Traceback" not in done.stderr
    done = _cli("pin", *common, "--tenant", "alice", token=TOKENS["bob"])
    assert done.returncode == 1 and "403" in done.stderr and "admin" in done.stderr
    done = _cli("pin", "--url", server.url, "--namespace", "x", "--token-ids", "1,2", token=None)
    assert done.returncode == 2 and "--block-size" in done.stderr
    done = _cli("pins", "--url", "http://127.0.0.1:1", token=TOKENS["ops"])
    assert done.returncode == 1 and "unreachable" in done.stderr
