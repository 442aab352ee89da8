"""Issue 7, part 5: bad input, in process. Generated inputs against the record decoder, the
batch framing, the key and namespace parsers and the server's upload checks.

What must hold: only the documented errors come out (``CorruptBlockError`` from the decoder,
``FrameError`` from the framing, ``ValueError`` for bad names), and a changed record never
decodes to other data under the same key.

Figures: ``fuzz_inputs`` and ``fuzz_crashes`` (see ``tests.faults.fuzzing.Tally``).
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachetier.errors import CorruptBlockError
from cachetier.primitives.keys import HASH_BYTES, parse_key
from cachetier.protocol.http_batch import (
    BatchReader,
    FrameError,
)
from cachetier.record import Compression, KVBlock, decode_record, encode_record, read_record
from cachetier.server.auth import Scope
from cachetier.server.service import BlockService
from cachetier.store.config import build_store
from tests.faults.fuzzing import (
    FUZZ_NS,
    NAME_ALPHABET,
    OTHER_NS,
    Tally,
    any_blocks,
    chunked_reader,
    frame,
    fuzz_settings,
    head_len_of,
    mutations,
    near_keys,
    near_namespaces,
)
from tests.server.live import test_config
from tests.support import make_blocks


def test_decoder_takes_arbitrary_bytes(tally: Tally) -> None:
    header_like = st.builds(
        lambda version, rest: b"CTKV" + struct.pack("<H", version) + rest,
        st.sampled_from([1, 1, 1, 0, 2, 65535]),
        st.binary(max_size=300),
    )

    @fuzz_settings(2500)
    @given(
        data=st.one_of(st.binary(max_size=400), header_like),
        key=st.none() | st.binary(min_size=32, max_size=32),
        fingerprint=st.none() | st.binary(min_size=32, max_size=32),
        streamed=st.booleans(),
    )
    def run(data: bytes, key: bytes | None, fingerprint: bytes | None, streamed: bool) -> None:
        tally.num_inputs += 1
        with tally.expect(CorruptBlockError):
            if streamed:
                read_record(io.BytesIO(data).readinto, len(data), key=key, fingerprint=fingerprint)
            else:
                decode_record(data, key=key, fingerprint=fingerprint)
            pytest.fail("random bytes decoded as a record")

    run()


def test_a_changed_record_never_decodes_to_other_data(tally: Tally) -> None:
    @fuzz_settings(3500)
    @given(data=st.data(), block=any_blocks(), lz4=st.booleans(), check=st.booleans())
    def run(data: st.DataObject, block: KVBlock, lz4: bool, check: bool) -> None:
        tally.num_inputs += 1
        record = encode_record(block, Compression.LZ4 if lz4 else Compression.NONE)
        mutated, resealed = data.draw(mutations(record, head_len_of(block)))
        key, fingerprint = (block.key, block.fingerprint) if check else (None, None)
        with tally.expect(CorruptBlockError):
            got = decode_record(mutated, key=key, fingerprint=fingerprint)
            # The checksum covers every other byte: an unsealed change must always be caught.
            assert resealed or mutated == record, "a changed record passed its checksum"
            assert bytes(got.data) == bytes(block.data), "a changed record decoded to other data"
            if check:
                assert (got.key, got.fingerprint) == (block.key, block.fingerprint)

    run()


def test_streamed_reads_of_changed_records(tally: Tally) -> None:
    @fuzz_settings(2000)
    @given(
        data=st.data(),
        block=any_blocks(),
        lz4=st.booleans(),
        check=st.booleans(),
        size_error=st.sampled_from([0, 0, 0, 0, -1, 1, -8, 8]),
        chunks=st.lists(st.integers(1, 64), max_size=6),
        into=st.booleans(),
    )
    def run(
        data: st.DataObject,
        block: KVBlock,
        lz4: bool,
        check: bool,
        size_error: int,
        chunks: list[int],
        into: bool,
    ) -> None:
        tally.num_inputs += 1
        record = encode_record(block, Compression.LZ4 if lz4 else Compression.NONE)
        mutated, resealed = data.draw(mutations(record, head_len_of(block)))
        size = max(0, len(mutated) + size_error)
        dest = memoryview(bytearray(memoryview(block.data).nbytes)) if into else None
        key, fingerprint = (block.key, block.fingerprint) if check else (None, None)
        with tally.expect(CorruptBlockError):
            got = read_record(
                chunked_reader(mutated, chunks),
                size,
                key=key,
                fingerprint=fingerprint,
                payload_into=dest,
            )
            # Only the first `size` bytes are the record (a file's size): bytes after them are
            # not its own.
            unchanged = size == len(record) and mutated[:size] == record
            assert resealed or unchanged, "a change was missed"
            assert bytes(got.data) == bytes(block.data), "a changed record read as other data"

    run()


def test_key_and_namespace_parsers_accept_only_their_alphabet(tally: Tally) -> None:
    @fuzz_settings(800)
    @given(
        key=st.one_of(near_keys(), st.text(max_size=70)),
        namespace=st.one_of(near_namespaces(), st.text(max_size=90)),
    )
    def run(key: str, namespace: str) -> None:
        tally.num_inputs += 1
        with tally.expect(ValueError):
            parsed = parse_key(key)
            # Whatever is accepted names exactly one 32-byte key, spelled exactly one way.
            assert len(parsed) == HASH_BYTES and parsed.hex() == key.lower(), repr(key)
        with tally.expect(ValueError):
            scope = Scope.of("alice", namespace)
            # A storage namespace becomes a folder and a Redis key: nothing outside its alphabet.
            assert set(scope.storage) <= NAME_ALPHABET, repr(namespace)

    run()


def feed_all(body: bytes, cuts: list[int]) -> list[memoryview | None]:
    reader = BatchReader(max_records=8, max_record_bytes=512, max_batch_bytes=2048)
    start = 0
    for cut in sorted(c % (len(body) + 1) for c in cuts):
        reader.feed(body[start:cut])
        start = cut
    reader.feed(body[start:])
    return reader.finish()


def test_batch_frames_parse_back_exactly_or_fail_cleanly(tally: Tally) -> None:
    records = st.lists(st.none() | st.binary(min_size=1, max_size=200), max_size=8)

    @fuzz_settings(2000)
    @given(
        data=st.data(),
        body_kind=st.sampled_from(["valid", "mutated", "random", "magic"]),
        cuts=st.lists(st.integers(0, 4096), max_size=5),
    )
    def run(data: st.DataObject, body_kind: str, cuts: list[int]) -> None:
        tally.num_inputs += 1
        sent = data.draw(records)
        body = frame(sent)
        if body_kind == "mutated":
            body = data.draw(mutations(body, None))[0]
        elif body_kind == "random":
            body = data.draw(st.binary(max_size=600))
        elif body_kind == "magic":
            body = b"CTB1" + data.draw(st.binary(max_size=600))
        with tally.expect(FrameError):
            got = feed_all(body, cuts)
            # The framing is canonical: what parses frames back to exactly the same bytes.
            assert frame([None if g is None else bytes(g) for g in got]) == body
            if body_kind == "valid":
                assert [None if g is None else bytes(g) for g in got] == sent

    run()


def test_upload_checks_refuse_every_bad_record(tally: Tally, tmp_path: Path) -> None:
    config = test_config(tmp_path, disk_bytes=0)
    service = BlockService(config, build_store(config.store))
    good = make_blocks(FUZZ_NS, 3) + make_blocks(OTHER_NS, 1)

    @fuzz_settings(600)
    @given(
        data=st.data(),
        picks=st.lists(st.integers(0, len(good) - 1), min_size=1, max_size=4),
        hex_namespace=st.booleans(),
        named_keys=st.booleans(),
    )
    def run(data: st.DataObject, picks: list[int], hex_namespace: bool, named_keys: bool) -> None:
        tally.num_inputs += 1
        scope = Scope.of("alice", FUZZ_NS.id if hex_namespace else "plain-fuzz")
        records: list[bytes | None] = []
        must_fail = False
        for i in picks:
            what = data.draw(st.sampled_from(["as is", "as is", "mutated", "missing"]))
            record = encode_record(good[i])
            if what == "mutated":
                record, resealed = data.draw(mutations(record, head_len_of(good[i])))
                must_fail |= not resealed and record != encode_record(good[i])
            must_fail |= what == "missing"
            records.append(None if what == "missing" else record)
        keys = None
        if named_keys:
            keys = [good[data.draw(st.sampled_from([i, picks[0]]))].key for i in picks]
        with tally.expect(CorruptBlockError):
            blocks = service.check_records(scope, records, keys)
            assert not must_fail, "a missing or corrupt record was accepted"
            for n, (block, i) in enumerate(zip(blocks, picks)):
                assert bytes(block.data) == bytes(good[i].data)
                assert keys is None or block.key == keys[n], "a record taken for another key"
                if hex_namespace:
                    assert block.fingerprint == FUZZ_NS.fingerprint, "foreign namespace taken"

    try:
        run()
    finally:
        service.close()
