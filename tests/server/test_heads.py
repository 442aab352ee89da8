"""The head cap's count of raw bytes: a head's end found across reads, and each head measured
from its own first byte."""

from __future__ import annotations

from cachetier.server.heads import HeadCap

HEAD = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_head_and_what_follows_it_are_told_apart() -> None:
    cap = HeadCap(64)
    assert cap.take(HEAD + b"body bytes") == len(HEAD)
    assert cap.num_bytes == len(HEAD)


def test_an_end_that_straddles_two_reads_is_found() -> None:
    cap = HeadCap(len(HEAD))
    assert cap.take(HEAD[:-2]) == len(HEAD) - 2
    assert cap.take(HEAD[-2:] + b"GET") == 2
    assert cap.num_bytes == len(HEAD)


def test_a_head_over_the_cap_is_refused_in_one_read_or_many() -> None:
    big = b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 100 + b"\r\n\r\n"
    assert HeadCap(len(big) - 1).take(big) is None
    cap = HeadCap(len(big) - 1)
    assert cap.take(big[:50]) == 50
    assert cap.take(big[50:]) is None
    assert HeadCap(len(big)).take(big) == len(big)  # exactly the cap fits


def test_each_head_is_measured_from_its_own_start() -> None:
    big = b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * 100 + b"\r\n\r\n"
    cap = HeadCap(64)
    data = HEAD + big
    size = cap.take(data)
    assert size == len(HEAD)
    cap.reset()  # the parser finished the first head
    assert cap.take(data[size:]) is None


def test_bytes_fed_unseen_count_whole() -> None:
    cap = HeadCap(40)
    cap.charge(b"x" * 30)
    assert cap.take(b"\r\n" + b"y" * 10 + b"\r\n\r\n") is None
