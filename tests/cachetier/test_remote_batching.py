"""How the remote tier cuts a put into requests the server accepts (``put_groups``)."""

from __future__ import annotations

from cachetier.primitives.keys import Namespace
from cachetier.record import encode_parts, plain_record_nbytes, record_nbytes
from cachetier.tiers.remote.batching import RequestLimits
from tests.support import make_blocks


def limits(**over: int) -> RequestLimits:
    base = dict(max_block_bytes=1000, max_batch_bytes=2500, max_batch_blocks=3, max_keys=10)
    return RequestLimits(**{**base, **over})


def test_records_fill_requests_in_order_up_to_the_byte_and_count_limits() -> None:
    # Each record costs 8 framing bytes on top of itself; the budget is 2500 - 8.
    groups, too_large = limits().put_groups([900, 900, 900, 100, 100, 100, 100])
    assert groups == [[0, 1], [2, 3, 4], [5, 6]]
    assert too_large == 0


def test_a_record_over_the_block_limit_is_left_out_and_counted() -> None:
    groups, too_large = limits().put_groups([1001, 10, 2493, 20])
    assert groups == [[1, 3]]
    assert too_large == 2


def test_groups_by_announced_length_match_the_encoded_records(namespace: Namespace) -> None:
    # The transfer put announces ``plain_record_nbytes`` before encoding: the same cut.
    blocks = make_blocks(namespace, 9)
    records = [encode_parts(b) for b in blocks]
    size = record_nbytes(records[0])
    cut = limits(max_block_bytes=size, max_batch_bytes=4 * size, max_batch_blocks=5)
    announced = cut.put_groups([plain_record_nbytes(b) for b in blocks])
    assert announced == cut.put_groups([record_nbytes(r) for r in records])
    assert [len(g) for g in announced[0]] == [3, 3, 3]
