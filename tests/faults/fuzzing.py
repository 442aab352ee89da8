"""Shared pieces of the fuzz tests: tiny blocks, the record header layout, the tally of
inputs and crashes, hypothesis strategies for blocks and record mutations, and a server whose
data folder sits beside a file it may not touch."""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cachetier.primitives.keys import DTYPE_BYTES, HASH_BYTES, BlockHash, KVLayout, Namespace
from cachetier.protocol.http_batch import batch_parts
from cachetier.record import KVBlock, encode_record
from tests.server.live import TOKENS, ThreadServer, test_config
from tests.support import make_blocks

# Tiny blocks (64 bytes of payload): the fuzzers move many of them, not big ones.
FUZZ_LAYOUT = KVLayout("float16", block_size=4, num_layers=1, num_kv_heads=1, head_dim=4)
FUZZ_NS = Namespace("fuzz-model", FUZZ_LAYOUT)
OTHER_NS = Namespace("fuzz-model", KVLayout("bfloat16", 4, 1, 1, 4))  # same model, other dtype
ALICE = TOKENS["alice"]
KNOWN_BLOCKS = make_blocks(FUZZ_NS, 4, seed=3)  # what schemathesis's record bodies are made of

# Offsets and struct formats of the record header fields (the layout in cachetier.record).
HEADER_FIELDS = {
    "version": (4, "<H"),
    "compression": (6, "<B"),
    "dtype": (7, "<B"),
    "ndim": (8, "<B"),
    "pad": (9, "<B"),
    "num_tokens": (10, "<I"),
    "aux_len": (78, "<I"),
    "payload_len": (82, "<Q"),
    "raw_len": (90, "<Q"),
    "shape0": (98, "<Q"),
}
FIXED_HEADER_BYTES = 98


class Tally:
    """What one fuzz test ran and saw; added to the session's figures when the test ends."""

    def __init__(self) -> None:
        self.num_inputs = 0
        self.crashes: set[str] = set()

    @contextmanager
    def expect(self, *allowed: type[BaseException]) -> Iterator[None]:
        """One input: the ``allowed`` errors are answers, anything else is a crash (re-raised).

        Crashes are kept by type and message, so hypothesis shrinking one failure into many
        runs still counts it once.
        """
        try:
            yield
        except allowed:
            pass
        except Exception as exc:
            self.crashes.add(f"{type(exc).__name__}: {str(exc)[:100]}")
            raise

    def answer(self, what: str, status: int) -> int:
        """Check one server answer: a 5xx is a crash."""
        if status >= 500:
            self.crashes.add(f"{what} -> {status}")
        assert status < 500, f"{what} answered {status}"
        return status


def fuzz_settings(num_examples: int) -> settings:
    # No deadline: two shared cores make single examples slow now and then.
    return settings(
        max_examples=num_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@st.composite
def any_blocks(draw: st.DrawFn) -> KVBlock:
    """A valid block of any dtype and a small shape; payloads random, zero or repetitive (so
    that LZ4 records occur too)."""
    dtype = draw(st.sampled_from(sorted(DTYPE_BYTES)))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    fill = draw(st.sampled_from(["random", "zeros", "repeat"]))
    if fill == "random":
        data = draw(st.binary(min_size=nbytes, max_size=nbytes))
    elif fill == "zeros":
        data = bytes(nbytes)
    else:
        data = (draw(st.binary(min_size=1, max_size=4)) * nbytes)[:nbytes]
    return KVBlock(
        BlockHash(draw(st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES))),
        draw(st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES)),
        dtype,
        shape,
        draw(st.integers(1, 2**32 - 1)),
        data,
        draw(st.binary(max_size=16)),
    )


def reseal(record: bytearray, head_len: int) -> None:
    """Recompute the checksum as a writer would, so checks past the checksum are reached."""
    digest = xxhash.xxh3_64(record[:head_len])
    digest.update(record[head_len + 8 :])
    record[head_len : head_len + 8] = digest.digest()


@st.composite
def mutations(draw: st.DrawFn, record: bytes, head_len: int | None) -> tuple[bytes, bool]:
    """``record`` changed by bit flips, a cut, an extension, overwritten bytes or a header
    field set to another value (then resealed or not).

    Args:
        record: a valid record (or any body when ``head_len`` is ``None``).
        head_len: bytes before the record's checksum; ``None`` for bodies without record
            header fields (no field changes then).

    Returns:
        The changed bytes, and whether the checksum was recomputed afterwards.
    """
    out = bytearray(record)
    kinds = ["flip", "truncate", "extend", "overwrite"] + ([] if head_len is None else ["field"])
    how = draw(st.sampled_from(kinds))
    if how == "flip":
        for at in draw(st.lists(st.integers(0, len(out) * 8 - 1), min_size=1, max_size=4)):
            out[at // 8] ^= 1 << (at % 8)
    elif how == "truncate":
        del out[draw(st.integers(0, len(out) - 1)) :]
    elif how == "extend":
        out += draw(st.binary(min_size=1, max_size=64))
    elif how == "overwrite":
        at = draw(st.integers(0, len(out) - 1))
        out[at : at + 8] = draw(st.binary(min_size=1, max_size=8))
    else:
        offset, fmt = HEADER_FIELDS[draw(st.sampled_from(sorted(HEADER_FIELDS)))]
        width = struct.calcsize(fmt)
        value = draw(
            st.one_of(
                st.integers(0, 2 ** (8 * width) - 1),
                st.sampled_from([0, 1, 2, 8, 9, 2 ** (8 * width) - 1]),
            )
        )
        struct.pack_into(fmt, out, offset, value)
    resealed = how == "field" and draw(st.booleans())
    if resealed:
        assert head_len is not None, "field changes only happen to records"
        reseal(out, head_len)
    return bytes(out), resealed


def head_len_of(block: KVBlock) -> int:
    return FIXED_HEADER_BYTES + 8 * len(block.shape)


def chunked_reader(data: bytes, sizes: list[int]) -> Callable[[memoryview], int]:
    """A ``readinto`` over ``data`` that returns short reads of the given sizes in turn."""
    stream = io.BytesIO(data)
    turn = iter(sizes)

    def readinto(buf: memoryview) -> int:
        limit = next(turn, buf.nbytes)
        return stream.readinto(buf[: max(1, min(limit, buf.nbytes))])

    return readinto


@st.composite
def near_keys(draw: st.DrawFn) -> str:
    """64 characters that look like a key: hex pairs with whitespace or other characters put
    between or over some of them."""
    pairs = [draw(st.binary(min_size=1, max_size=1)).hex() for _ in range(32)]
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(pairs) - 1))
        pairs.insert(at, draw(st.sampled_from([" ", "\t", "\n", "\r", "\x0b", "g", "-", "x"])))
    return "".join(pairs)[:64]


@st.composite
def near_namespaces(draw: st.DrawFn) -> str:
    """A valid namespace with path, control or other characters put before, in or after it."""
    base = draw(st.text(alphabet="abcXYZ019._-", min_size=1, max_size=20))
    odd = draw(st.text(alphabet="/\\\n\r\t\0 .%~:", min_size=1, max_size=3))
    at = draw(st.integers(0, len(base)))
    return base[:at] + odd + base[at:]


NAME_ALPHABET = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def frame(records: list[bytes | None]) -> bytes:
    parts, _ = batch_parts([None if r is None else [r] for r in records])
    return b"".join(bytes(p) for p in parts)


def with_canary(folder: Path) -> Path:
    """``folder``, to hold a server's data folder beside a file it may not touch (``canary``)."""
    canary = folder / "canary"
    canary.mkdir()
    (canary / "secret.ctkv").write_bytes(encode_record(make_blocks(FUZZ_NS, 1, seed=9)[0]))
    return folder


def serve_inside(outer: Path) -> Iterator[ThreadServer]:
    """A server whose data folder is ``outer/data``, for a fixture to yield from; once it is
    stopped, nothing but the canary may lie outside that folder."""
    running = ThreadServer(test_config(outer / "data")).start()
    yield running
    running.stop()
    # Whatever the requests were, the server wrote inside its data folder only.
    assert files_outside(outer, outer / "data") == ["canary/secret.ctkv"]


def files_outside(top: Path, root: Path) -> list[str]:
    """The files under ``top`` that lie outside ``root``, relative to ``top`` and sorted."""
    out = []
    for folder, _, names in os.walk(top):
        for name in names:
            path = Path(folder) / name
            if not path.resolve().is_relative_to(root.resolve()):
                out.append(str(path.relative_to(top)))
    return sorted(out)


# The router's inputs: OpenAI request bodies, right, odd and hostile.
TOKEN_IDS = st.one_of(
    st.integers(0, 255),
    st.sampled_from([-1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64, 2**70, -(2**70)]),
    st.integers(-(2**80), 2**80),
)
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.integers(-5, 5), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def openai_bodies(draw: st.DrawFn) -> dict:
    """A completion or chat body whose every field may be right, odd or hostile; ``max_tokens``
    stays small or invalid, so that no answer takes long to generate."""
    body: dict = {}
    prompt = draw(
        st.one_of(
            st.lists(TOKEN_IDS, max_size=40),
            st.text(max_size=200),
            st.lists(st.text(max_size=10), max_size=3),
            st.lists(st.lists(st.integers(0, 255), max_size=5), max_size=3),
            ODD_VALUES,
        )
    )
    if draw(st.booleans()):
        body["prompt"] = prompt
    if draw(st.booleans()):
        message = st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | ODD_VALUES,
                "content": st.text(max_size=60) | ODD_VALUES | JSON_VALUES,
            },
        )
        body["messages"] = draw(st.lists(message, max_size=3) | ODD_VALUES)
    body["max_tokens"] = draw(st.sampled_from([1, 2, 0, -1, 2**70, "2", None, 1.5]))
    for name in ("temperature", "stream", "user", "model", "n", "stop", "logprobs", "seed"):
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(ODD_VALUES)
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.text(max_size=12))] = draw(JSON_VALUES)
    return body


def nested_json(depth: int, opener: bytes = b"[") -> bytes:
    """An object whose one field nests ``depth`` arrays (or objects) deep."""
    if opener == b"[":
        inner = b"[" * depth + b"]" * depth
    else:
        inner = b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"prompt": [1, 2], "x": ' + inner + b"}"


@st.composite
def raw_json_bodies(draw: st.DrawFn) -> bytes:
    """Bytes that are almost a request body: cut, nested deep, huge numbers, not UTF-8."""
    kind = draw(st.sampled_from(["cut", "deep", "number", "binary", "surrogate", "empty"]))
    if kind == "cut":
        whole = json.dumps(draw(openai_bodies())).encode()
        return whole[: draw(st.integers(0, max(len(whole) - 1, 0)))]
    if kind == "deep":
        depth = draw(st.sampled_from([63, 64, 65, 999, 1000, 5000, 100_000]))
        return nested_json(depth, draw(st.sampled_from([b"[", b"{"])))
    if kind == "number":
        number = draw(st.sampled_from([b"1e999999", b"-1e400", b"NaN", b"Infinity", b"9" * 5000]))
        return b'{"prompt": [' + number + b'], "max_tokens": 1}'
    if kind == "surrogate":
        return b'{"prompt": "a\\ud800b", "max_tokens": 1}'
    if kind == "empty":
        return draw(st.sampled_from([b"", b"{}", b"null", b"[]", b'"x"', b"1"]))
    return draw(st.binary(max_size=200))
