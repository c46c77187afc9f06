"""Hostile store entries: what someone with write access to ``data.mdb`` can
plant. Each entry is self-consistent (the record matches the blob, the
checksum is recomputed, ``total_bytes`` is kept exact), so only ecstore's
entry check (``blob_check.check_entry``) stands between it and the caller.

Used by tests/store/test_hostile_entries.py, in-process and in worker processes
(``ecstore.testing.faults.run_forked``: a hostile entry may crash an unfixed reader).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ecstore import ECStore, ECStoreConfig
from ecstore.format import codec
from ecstore.lmdb.txn import _U64

MODEL = "hostile/model"
IDENT = "victim-image"
MiB = 1 << 20

#: name -> (change to the header dict, data bytes to store or None = keep)
Edit = Callable[[dict[str, Any]], None]


def good_tensor() -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32).reshape(4, 16) + 0.5


def _meta(**kw: Any) -> Edit:
    return lambda h: h["__metadata__"].update(kw)


def _both(meta: dict[str, Any], info: dict[str, Any]) -> Edit:
    def f(h: dict[str, Any]) -> None:
        h["__metadata__"].update(meta)
        h["ec"].update(info)
    return f


#: Hostile headers for the float32 [4, 16] entry (256 data bytes). The third
#: item is the number of data bytes stored after the header (None: the 256).
CASES: dict[str, tuple[Edit, int | None]] = {
    # quantized dtypes claim fewer bytes than they are given (heap overflow before the fix)
    "dtype quint4x2": (_both({"dtype": "quint4x2", "shape": "[16, 16]"}, {"dtype": "U8", "shape": [256]}), None),
    "dtype quint2x4": (_both({"dtype": "quint2x4", "shape": "[16, 16]"}, {"dtype": "U8", "shape": [256]}), None),
    "dtype qint8": (_both({"dtype": "qint8", "shape": "[16, 16]"}, {"dtype": "U8", "shape": [256]}), None),
    "metadata dtype 5": (_meta(dtype=5), None),
    "metadata dtype null": (_meta(dtype=None), None),
    "metadata dtype list": (_meta(dtype=["float32"]), None),
    "negative shape": (_meta(shape="[-4, -16]"), None),
    "overflowing shape, no data": (_both({"shape": "[0, 1180591620717411303424]"},
                                         {"shape": [0, 16], "data_offsets": [0, 0]}), 0),
    "overflowing safetensors shape": (_both({}, {"shape": [4, 1180591620717411303424]}), None),
    "negative data_offsets (header bytes as data)": (_both({}, {"data_offsets": [-8, 248]}), 248),
    "data_offsets past the end": (_both({}, {"data_offsets": [0, 1 << 40]}), None),
    "data_offsets not integers": (_both({}, {"data_offsets": ["0", "256"]}), None),
    "another model": (_meta(model="other/model"), None),
    "another dtype of the same size (int32)": (_both({"dtype": "int32"}, {"dtype": "I32"}), None),
    "dtype alias 'float'": (_meta(dtype="float"), None),
    "float shape": (_meta(shape="[4.0, 16]"), None),
    "bool in shape": (_meta(shape="[true, 64]"), None),
    "shape not JSON": (_meta(shape="four by sixteen"), None),
    "metadata not an object": (lambda h: h.update({"__metadata__": ["ecstore/1"]}), None),
    "safetensors dtype code differs": (_both({}, {"dtype": "I32"}), None),
    "safetensors shape differs": (_both({}, {"shape": [8, 8]}), None),
    "extra tensor": (lambda h: h.update({"other": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}), None),
}


def hostile_blob(edit: Edit, data_len: int | None, tensor: torch.Tensor | None = None,
                 identifier: str = IDENT, model: str = MODEL) -> bytes:
    """The blob of ``tensor`` with ``edit`` applied to its header; the data
    is the tensor's bytes cut or zero-padded to ``data_len``."""
    t = good_tensor() if tensor is None else tensor
    good = bytes(codec.encode(t, identifier=identifier, model=model))
    hlen = struct.unpack_from("<Q", good, 0)[0]
    header = json.loads(good[8:8 + hlen])
    edit(header)
    data = good[8 + hlen:]
    if data_len is not None:
        data = (data + bytes(max(0, data_len - len(data))))[:data_len]
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + data


def consistent_record(rec: codec.Record, blob: bytes) -> codec.Record:
    """``rec`` made to agree with ``blob``: size, checksum, and the dtype,
    shape and data bytes the header claims (where it claims a usable value)."""
    hlen = struct.unpack_from("<Q", blob, 0)[0]
    dtype, shape = rec.dtype, rec.shape
    try:
        meta = json.loads(blob[8:8 + hlen])["__metadata__"]
        if isinstance(meta["dtype"], str) and meta["dtype"].isascii():
            dtype = meta["dtype"]
        s = json.loads(meta["shape"])
        if isinstance(s, list) and all(type(d) is int and 0 <= d < 1 << 64 for d in s):
            shape = tuple(s)
    except Exception:  # noqa: BLE001
        pass
    return replace(rec, dtype=dtype, shape=shape, nbytes=len(blob) - 8 - hlen, blob_size=len(blob),
                   checksum=codec.checksum(blob))


def plant(store: ECStore, identifier: str, blob: bytes) -> None:
    """Replace ``identifier``'s stored entry by ``blob`` with a consistent
    record, keeping its LRU position and ``total_bytes`` exact."""
    tier = store.disk
    assert tier is not None
    k = store.key(identifier).encode()
    with tier._write_txn() as txn:
        rec = codec.unpack_record(txn.get(k, db=tier._dbs.entries))
        new = consistent_record(rec, blob)
        txn.put(k, blob, db=tier._dbs.blobs)
        txn.put(k, codec.pack_record(new), db=tier._dbs.entries)
        total = _U64.unpack(txn.get(b"total_bytes", db=tier._dbs.meta))[0]
        txn.put(b"total_bytes", _U64.pack(total - rec.blob_size + len(blob)), db=tier._dbs.meta)


def open_f32(path: str | Path) -> ECStore:
    cfg = ECStoreConfig(local_cpu=False, local_disk=str(path), max_local_disk_size=64 * MiB / (1 << 30))
    return ECStore(cfg, model=MODEL, dtype=torch.float32)


def get_hostile(path: str, case: str) -> dict[str, Any]:
    """In a fresh store at ``path``: store the victim and a bystander, plant
    ``CASES[case]`` over the victim, ``get`` it. Returns what happened."""
    from helpers.tensors import same_tensor

    edit, data_len = CASES[case]
    out: dict[str, Any] = {}
    with open_f32(path) as s:
        s.put(IDENT, good_tensor())
        s.put("bystander", good_tensor() * 2)
        s.flush()
        plant(s, IDENT, hostile_blob(edit, data_len))
        try:
            got = s.get(IDENT)
        except BaseException as e:  # the outcome under test  # noqa: BLE001
            out["get"] = f"raised {type(e).__name__}: {e}"
        else:
            out["get"] = "miss" if got is None else ("hit, exact" if same_tensor(got, good_tensor())
                                                     else f"hit, wrong: {got.dtype} {list(got.shape)}")
        out["still_stored"] = s.contains(IDENT)
        out["corrupt_dropped"] = s.stats().corrupt_dropped
        out["bystander_ok"] = same_tensor(s.get("bystander"), good_tensor() * 2)
    return out
