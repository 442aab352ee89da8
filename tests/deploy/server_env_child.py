"""Run by the python of a server-only venv (``tests/deploy/server_env.py``), never by the tests'
own: it may import only the standard library and what ``cachetier[server]`` installed.

Its one argument is a JSON object of settings; each tier it names gets three chained blocks put
and read back:

    data_dir                     a DiskTier there (lz4), and always a CPUTier
    redis_url, redis_prefix      a RedisTier
    remote_url, remote_token     a RemoteTier (the sidecar's client)

It prints one JSON line: which modules exist (``modules``), where ``cachetier`` was imported
from, the modules of the installed ``cachetier`` that failed to import, and per tier the
blocks stored, found and found intact.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import sys
from pathlib import Path

MODULES = ("torch", "transformers", "vllm", "triton", "matplotlib", "tqdm", "fastapi", "uvicorn")

NEEDS_TORCH = {"engine", "kernels", "connectors"}


def main(settings: dict) -> dict:
    # Looked up before cachetier is imported, and never imported: what pip installed.
    modules = {name: importlib.util.find_spec(name) is not None for name in MODULES}
    import cachetier

    failed = []
    for info in pkgutil.walk_packages(cachetier.__path__, "cachetier.", onerror=lambda _: None):
        # The engine, the kernels and the connectors need the `engine` extra (torch), which
        # the sidecar's env has not; a __main__ runs a command when imported.
        if info.name.split(".")[1] in NEEDS_TORCH or info.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # every failure is the answer, not only the first
            failed.append(f"{info.name}: {exc!r}")
    return {
        "modules": modules,
        "cachetier_file": cachetier.__file__,
        "import_failures": failed,
        "tiers": {name: _roundtrip(tier) for name, tier in _tiers(settings)},
    }


def _tiers(settings: dict) -> list:
    from cachetier.tiers.cpu import CPUTier, CPUTierConfig

    tiers = [("cpu", CPUTier(CPUTierConfig(capacity_bytes=1 << 20)))]
    if settings.get("data_dir"):
        from cachetier.tiers.disk.config import DiskTierConfig
        from cachetier.tiers.disk.tier import DiskTier

        root = str(Path(settings["data_dir"]) / "disk")
        config = DiskTierConfig(root, 1 << 24, compression="lz4", fsync=False)
        tiers.append(("disk", DiskTier(config)))
    if settings.get("redis_url"):
        from cachetier.tiers.redis import RedisTier, RedisTierConfig

        config = RedisTierConfig(url=settings["redis_url"], key_prefix=settings["redis_prefix"])
        tiers.append(("redis", RedisTier(config)))
    if settings.get("remote_url"):
        from cachetier.tiers.remote import RemoteTier, RemoteTierConfig

        config = RemoteTierConfig(url=settings["remote_url"], token=settings["remote_token"])
        tiers.append(("remote", RemoteTier(config)))
    return tiers


def _roundtrip(tier) -> dict:  # noqa: ANN001 - a Tier of the venv's cachetier
    import numpy as np

    from cachetier.primitives.keys import KVLayout, Namespace, block_keys
    from cachetier.record import KVBlock

    layout = KVLayout("float16", block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
    ns = Namespace("server-env-child", layout)
    rng = np.random.default_rng(7)
    keys = block_keys(ns, rng.integers(0, 50_000, size=3 * layout.block_size))
    shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    blocks = [
        KVBlock(k, ns.fingerprint, "float16", shape, layout.block_size, _payload(rng, shape))
        for k in keys
    ]
    with tier:
        stored = tier.put_many(ns.id, blocks)
        got = tier.get_many(ns.id, keys)
    return {
        "stored": stored,
        "found": sum(g is not None for g in got),
        "intact": sum(
            g is not None and bytes(g.data) == bytes(b.data) for g, b in zip(got, blocks)
        ),
    }


def _payload(rng, shape: tuple[int, ...]) -> bytes:  # noqa: ANN001 - a numpy Generator
    return rng.standard_normal(shape).astype("float16").tobytes()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
