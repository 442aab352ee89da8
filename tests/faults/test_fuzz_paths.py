"""Issue 7, part 5: names that try to leave the disk root. Namespaces and keys made to look like
paths, given to the disk tier and, quoted, to a real server; and a stray file in the root.

What must hold: every such name is refused or kept inside the root, nothing outside it is read
or written, and a file that is not a record is never taken for one.

Figures: ``fuzz_inputs`` and ``fuzz_crashes`` (see ``tests.faults.fuzzing.Tally``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachetier.primitives.keys import HASH_BYTES, BlockHash
from cachetier.protocol.http_batch import BATCH_MEDIA_TYPE, RECORD_MEDIA_TYPE
from cachetier.record import encode_record
from cachetier.tiers.disk.budget import LEDGER_NAME
from cachetier.tiers.disk.files import OWNERS_DIR
from cachetier.tiers.disk.tier import DiskTier, DiskTierConfig
from tests.faults.fuzzing import (
    ALICE,
    FUZZ_NS,
    NAME_ALPHABET,
    Tally,
    files_outside,
    frame,
    fuzz_settings,
    near_namespaces,
    serve_inside,
    with_canary,
)
from tests.server.live import ThreadServer, call
from tests.support import make_blocks


# A server no other test talks to: a server the fuzzing talks to may hold files it wrote there
# legitimately (a generated pin request that succeeds writes pins.json), and the test below
# asserts exactly which files a path attack leaves.
@pytest.fixture
def own_outer(tmp_path: Path) -> Path:
    return with_canary(tmp_path)


@pytest.fixture
def own_server(own_outer: Path) -> Iterator[ThreadServer]:
    yield from serve_inside(own_outer)


ESCAPES = [
    "../../etc",
    "..",
    ".",
    "/etc",
    "/tmp/cachetier-escape",
    "a/../../canary",
    "../canary",
    "a\0b",
    "x" * 300,
    "",
    "ns\n",
    "..\\..\\canary",
    "~",
    "%2e%2e",
    "C:\\canary",
]


def test_disk_tier_names_stay_inside_its_root(tally: Tally, tmp_path: Path) -> None:
    root = tmp_path / "root"
    (tmp_path / "canary").mkdir()
    (tmp_path / "canary" / "keep").write_bytes(b"outside the root")
    tier = DiskTier(DiskTierConfig(str(root), capacity_bytes=1 << 20, fsync=False))
    block = make_blocks(FUZZ_NS, 1)[0]
    # A key is bytes named by its hex form: even path-like bytes cannot name a path.
    path_key = BlockHash(b"../../canary/keep/../../".ljust(HASH_BYTES, b"/"))

    def try_everything(namespace: str) -> None:
        tally.num_inputs += 1
        with tally.expect(ValueError):
            tier.put_many(namespace, [block])
        for key in (block.key, path_key):
            with tally.expect(ValueError):
                tier.get_many(namespace, [key])
            with tally.expect(ValueError):
                tier.contains_prefix(namespace, [key])
            with tally.expect(ValueError):
                tier.delete(namespace, [key])
        with tally.expect(ValueError):
            tier.clear(namespace)

    for namespace in ESCAPES:
        try_everything(namespace)

    @fuzz_settings(300)
    @given(namespace=st.one_of(near_namespaces(), st.text(max_size=140)))
    def run(namespace: str) -> None:
        try_everything(namespace)

    run()
    tier.close()
    assert files_outside(tmp_path, root) == ["canary/keep"]
    assert (tmp_path / "canary" / "keep").read_bytes() == b"outside the root"


def test_server_paths_stay_inside_the_data_folder(
    tally: Tally, own_server: ThreadServer, own_outer: Path
) -> None:
    server, outer = own_server, own_outer
    block = make_blocks(FUZZ_NS, 1, seed=9)[0]  # the record the canary file holds
    record = encode_record(block)
    quoted = [
        "..",
        "%2e%2e",
        "..%2F..%2Fcanary",
        "%2Fetc",
        "a%00b",
        "x" * 300,
        "ns%0A",
        "..%5C..%5Ccanary",
        "t.bob.ns",
        "%2E%2E%2F%2E%2E%2F%2E%2E%2Fcanary",
    ]
    keys = [block.key.hex(), "..%2F..%2F..%2Fcanary%2Fsecret", "%00" * 32, "00" * 31 + "%20%20"]
    for namespace in quoted:
        for key in keys:
            base = f"/v1/namespaces/{namespace}"
            for method, path, body, content_type in [
                ("PUT", f"{base}/blocks/{key}", record, RECORD_MEDIA_TYPE),
                ("GET", f"{base}/blocks/{key}", None, None),
                ("HEAD", f"{base}/blocks/{key}", None, None),
                ("DELETE", f"{base}/blocks/{key}", None, None),
                ("POST", f"{base}/batch/put", frame([record]), BATCH_MEDIA_TYPE),
                ("DELETE", base, None, None),
            ]:
                tally.num_inputs += 1
                status, _, answer = call(
                    server.url, method, path, body, token=ALICE, content_type=content_type
                )
                tally.answer(f"{method} {path}", status)
                if namespace == "t.bob.ns" and key == block.key.hex():
                    continue  # a valid name of alice's own: filed under t.alice.t.bob.ns
                if status == 200 and method in ("GET", "HEAD"):
                    pytest.fail(f"{method} {path} found a block through a made-up path")
    # Beside the blocks the data folder holds only the pin registry's lock (taken at start).
    assert files_outside(outer, outer / "data" / "blocks") == [
        "canary/secret.ctkv",
        "data/pins.json.lock",
    ]
    assert (outer / "canary" / "secret.ctkv").read_bytes() == record
    for folder in (outer / "data" / "blocks").iterdir():
        if folder.name in (LEDGER_NAME, OWNERS_DIR):
            continue  # the disk tier's own byte ledger and owner marks, not namespaces
        assert folder.name.startswith("t.alice.") and set(folder.name) <= NAME_ALPHABET, folder


def test_a_stray_file_in_the_disk_root_is_ignored(tally: Tally, tmp_path: Path) -> None:
    # 64 characters before the suffix, two of them spaces: not a key, whatever fromhex says.
    shard = tmp_path / FUZZ_NS.id / "00"
    shard.mkdir(parents=True)
    (shard / ("  " + "00" * 31 + ".ctkv")).write_bytes(b"not a record")
    tally.num_inputs += 1
    tier = DiskTier(DiskTierConfig(str(tmp_path), capacity_bytes=4096, fsync=False))
    assert len(tier) == 0
    blocks = make_blocks(FUZZ_NS, 40)  # more than fit: eviction runs
    with tally.expect():
        assert tier.put_many(FUZZ_NS.id, blocks) == 40
    tier.close()
