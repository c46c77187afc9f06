"""The one place entry bytes are interpreted: a stored entry is a safetensors
blob (``codec``) whose header carries the encoder's record (``record``);
``blob_check`` validates a blob without trusting it, ``blob_read`` decodes
and verifies it into a tensor (``split_read`` on two threads for large
entries). Pure functions over bytes and buffers: no I/O of their own, safe
from any thread.

This package is the format's one public surface: other layers import from
``ecstore.format`` (the names below, or its modules as namespaces:
``from ecstore.format import codec``), never a private name of a module.

``put`` holds the record of an entry on its way to a tier (the writer, the
LMDB batch and the remote queue share it), its outcome, and the bookkeeping
of a queue of them.
"""

from __future__ import annotations

from ecstore.format import blob_check, blob_read, codec, put, record, split_read
from ecstore.format.blob_check import BlobHeader, check_entry, check_put_shape, parse_header
from ecstore.format.blob_read import decode, read_entry, read_file_entry
from ecstore.format.codec import (
    ST_CODE,
    blob_size,
    check_storable,
    checksum,
    encode,
    encode_view,
    raw_bytes_view,
    tensor_nbytes,
)
from ecstore.format.put import PendingPut, PutOutcome, PutQueue
from ecstore.format.record import (
    LEGACY_RECORD_VERSION,
    RECORD_VERSION,
    Record,
    pack_record,
    record_identifier,
    record_readable,
    unpack_record,
)
from ecstore.format.split_read import SPLIT_READ_BYTES

__all__ = [
    "blob_check", "blob_read", "codec", "put", "record", "split_read",
    "BlobHeader", "check_entry", "check_put_shape", "parse_header",
    "decode", "read_entry", "read_file_entry",
    "ST_CODE", "blob_size", "check_storable", "checksum", "encode", "encode_view", "raw_bytes_view",
    "tensor_nbytes",
    "LEGACY_RECORD_VERSION", "RECORD_VERSION", "Record", "pack_record", "record_identifier",
    "record_readable", "unpack_record",
    "SPLIT_READ_BYTES",
    "PendingPut", "PutOutcome", "PutQueue",
]
