"""Incremental text: multi-byte characters never split, stop strings never shown."""

from __future__ import annotations

import pytest

from cachetier.engine.server.text_stream import TextStream


def decode(ids: list[int]) -> str:
    # What the byte-level tokenizer of the tests does: token id b is byte b.
    return bytes(ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, text: str, final: bool = True) -> list[str]:
    data = list(text.encode())
    deltas = [
        stream.update(data[: i + 1], final=final and i == len(data) - 1) for i in range(len(data))
    ]
    return deltas


def test_multibyte_characters_come_out_whole() -> None:
    stream = TextStream(decode)
    deltas = feed(stream, "a€😀b")
    assert "".join(deltas) == "a€😀b" == stream.text
    assert "\ufffd" not in "".join(deltas)
    assert [d for d in deltas if d] == ["a", "€", "😀", "b"]


def test_invalid_bytes_are_sent_once_more_text_follows() -> None:
    stream = TextStream(decode)
    assert stream.update([0xFF]) == ""  # could be the start of a character: held
    assert stream.update([0xFF, 0x41]) == "\ufffdA"
    assert stream.update([0xFF, 0x41, 0xE2], final=True) == "\ufffd"


def test_a_stop_string_ends_the_text_before_it() -> None:
    stream = TextStream(decode, stop=["STOP", "\n\n"])
    deltas = feed(stream, "hello ST wait STOP and more", final=False)
    assert stream.stopped
    assert "".join(deltas) == "hello ST wait " == stream.text
    assert stream.update(list(b"anything")) == ""


def test_text_that_may_start_a_stop_string_is_held_until_it_does_not() -> None:
    stream = TextStream(decode, stop=["END"])
    # The last len("END") - 1 characters wait: they could be the start of "END".
    assert stream.update(list(b"abcE")) == "ab"
    assert stream.update(list(b"abcEN")) == "c"
    assert stream.update(list(b"abcENx")) == "E"
    assert stream.update(list(b"abcENxE"), final=True) == "NxE"
    assert not stream.stopped


def test_stop_strings_need_a_tokenizer_and_must_not_be_empty() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        TextStream(None, stop=["x"])
    with pytest.raises(ValueError, match="empty"):
        TextStream(decode, stop=[""])
    assert TextStream(None).update([1, 2, 3], final=True) == ""
