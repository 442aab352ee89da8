"""The self-describing binary record every tier stores a block as.

Layout (little-endian)::

    magic "CTKV" | version u16 | compression u8 | dtype u8 | ndim u8 | pad u8 | num_tokens u32
    key 32B | namespace fingerprint 32B | aux_len u32 | payload_len u64 | raw_len u64
    shape ndim x u64 | writer 16B | checksum u64 | aux (aux_len B) | payload (payload_len B)

The checksum covers every byte of the record but itself, so a torn write, a flipped bit or a
truncated file is always caught. The key and the fingerprint are checked against what the
caller asked for, so a record can never be served under another key or another model.

Version 3, the one written, is version 2 with the writer: the id of the process that wrote the
record (``cachetier.record.writer``), inside the checksummed head, so the restore guard can
trust and quarantine writers one by one. Versions 1 and 2 are read with an unknown writer.

Version 2: the record is cut into ``SEGMENT_BYTES`` segments at fixed
offsets from its first byte (the checksum field's 8 bytes are left out of the first), each is
hashed with xxh3-64, and the checksum is the xxh3-64 of those digests in order. A large record
can then be read on two threads that each hash the segments they read while those are still in
their own core's cache: one stream over the whole record made the second thread's share be
hashed again, out of cache, by the first. Version 1 (one xxh3-64 over the
record but the checksum field) is still read; a version-1 reader refuses version 2 as unknown,
a clean miss.
"""

from cachetier.record.block import MAX_NDIM, Buffer, KVBlock, byte_view
from cachetier.record.codec import (
    FORMAT_VERSION,
    MAGIC,
    PEEK_BYTES,
    SEGMENT_BYTES,
    Compression,
    decode_record,
    encode_parts,
    encode_record,
    peek_inflated_nbytes,
    peek_key,
    plain_record_nbytes,
    record_checksum,
    record_nbytes,
    reseal,
)
from cachetier.record.reading import read_record
from cachetier.record.writer import UNKNOWN_WRITER, process_writer, writer_name, writer_of

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_NDIM",
    "PEEK_BYTES",
    "SEGMENT_BYTES",
    "UNKNOWN_WRITER",
    "Buffer",
    "Compression",
    "KVBlock",
    "byte_view",
    "decode_record",
    "encode_parts",
    "encode_record",
    "peek_inflated_nbytes",
    "peek_key",
    "plain_record_nbytes",
    "process_writer",
    "read_record",
    "record_checksum",
    "record_nbytes",
    "reseal",
    "writer_name",
    "writer_of",
]
