"""The two install shapes (issue 19), measured: the sidecar's venv, holding only
``cachetier[server]`` (built from this checkout by ``scripts/setup_server.sh``, as the sidecar
image and ``tests/deploy/test_server_install.py`` build it), beside the full ``.venv`` of
``make setup``.

- ``server_only_env_mib``: disk use of the fresh server-only venv (as ``du`` counts it);
- ``server_only_env_has_torch`` / ``_has_transformers`` / ``_has_vllm``: importable there;
- ``server_only_env_import_failures``: modules of the installed cachetier that fail to import;
- ``server_only_env_tiers_ok``: tiers whose put and get of 3 blocks came back intact there;
- ``server_only_env_serves``: its ``cachetier serve`` (CPU, disk, Redis) stored and returned
  blocks for this checkout's ``RemoteTier`` and for the venv's own;
- ``server_only_env_build_s``: seconds to build it (pip's cache as it is);
- ``full_env_mib``: disk use of this checkout's ``.venv`` (``None`` without one).

    python -m benchmarks.ops.install --json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.support.children import REPO_ROOT
from benchmarks.support.output import emit
from cachetier.primitives.keys import Namespace
from cachetier.tiers.remote import RemoteTier, RemoteTierConfig
from tests.deploy.server_env import (
    ServerEnv,
    disk_usage_mib,
    make_server_env,
    serving,
)
from tests.server.live import TOKENS
from tests.support import SMALL_LAYOUT, make_blocks, own_redis_prefix

REDIS_URL = "redis://127.0.0.1:6379/0"
INTACT = {"stored": 3, "found": 3, "intact": 3}


def measure_server_env(redis_url: str = REDIS_URL, workdir: Path | None = None) -> dict[str, Any]:
    """Build the server-only venv in a temporary folder, measure it, and serve from it.

    Args:
        redis_url: the Redis the tiers and the sidecar use (keys under a prefix of their own,
            deleted after).
        workdir: where the temporary folder goes (default: the system's).

    Returns:
        The figures of this module's docstring.
    """
    with tempfile.TemporaryDirectory(prefix="cachetier-server-env-", dir=workdir) as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        env = make_server_env(folder / "venv")
        build_s = time.perf_counter() - start
        with own_redis_prefix(redis_url, "ops-install") as prefix:
            settings = {"data_dir": str(folder), "redis_url": redis_url, "redis_prefix": prefix}
            probe = env.probe(settings)
        with own_redis_prefix(redis_url, "ops-install-serve") as prefix:
            serves = _serves(env, folder / "data", redis_url, prefix)
        result: dict[str, Any] = {
            "server_only_env_mib": round(env.size_mib(), 1),
            "server_only_env_has_torch": probe["modules"]["torch"],
            "server_only_env_has_transformers": probe["modules"]["transformers"],
            "server_only_env_has_vllm": probe["modules"]["vllm"],
            "server_only_env_has_report": probe["modules"]["matplotlib"],
            "server_only_env_import_failures": len(probe["import_failures"]),
            "server_only_env_tiers_ok": sorted(t for t, r in probe["tiers"].items() if r == INTACT),
            "server_only_env_serves": serves,
            "server_only_env_build_s": round(build_s, 1),
        }
    venv = REPO_ROOT / ".venv"
    result["full_env_mib"] = round(disk_usage_mib(venv), 1) if venv.exists() else None
    return result


def _serves(env: ServerEnv, data_dir: Path, redis_url: str, prefix: str) -> bool:
    ns = Namespace("ops-install", SMALL_LAYOUT)
    blocks = make_blocks(ns, 6)
    with serving(env, data_dir, TOKENS, "ops", redis_url, prefix) as served:
        with RemoteTier(RemoteTierConfig(url=served.url, token=TOKENS["alice"])) as tier:
            ours = tier.put_many(ns.id, blocks) == 6
            ours = ours and tier.get_many(ns.id, [b.key for b in blocks]) == blocks
        theirs = env.probe({"remote_url": served.url, "remote_token": TOKENS["bob"]})
    return ours and theirs["tiers"]["remote"] == INTACT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="the result as the last line")
    parser.add_argument("--redis-url", default=REDIS_URL)
    args = parser.parse_args()
    emit(measure_server_env(args.redis_url), args.json)


if __name__ == "__main__":
    main()
