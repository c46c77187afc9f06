"""Functions tests/store/test_faults.py runs in worker processes
(``fault_common.run_forked``): each opens its own store, does one risky
thing and returns a small picklable report. Kept apart from the test module
so a worker imports only this (light) module."""

from __future__ import annotations

import contextlib
import io
import os
import resource
import signal
from pathlib import Path

import torch

from ecstore import ECStore, ECStoreConfig, SchemaError, StoreFullError, StoreOpenError
from ecstore.testing import faults as fc

MiB = 1 << 20
GiB = 1 << 30


def cfg(path: Path | str, cap: int, cpu: int = 0, file_blob_mib: float = 4.0) -> ECStoreConfig:
    return ECStoreConfig(local_cpu=cpu > 0, max_local_cpu_size=cpu / GiB, local_disk=str(path),
                         max_local_disk_size=cap / GiB, min_file_blob_size=file_blob_mib)


def open_store(path: Path | str, cap: int = 64 * MiB, **kw) -> ECStore:
    return ECStore(cfg(path, cap, kw.pop("cpu", 0), kw.pop("file_blob_mib", 4.0)), model=kw.pop("model", fc.MODEL),
                   dtype=kw.pop("dtype", torch.bfloat16), **kw)


def blob_tensor(i: int, kib: int) -> torch.Tensor:
    """A bf16 ``[kib, 512]`` tensor (``kib`` KiB) whose bytes depend on ``i``."""
    return fc.entry_tensor(i, kib)


def verify_in_process(path: str) -> tuple[int, str]:
    """``ecstore-dump verify PATH`` (``ecstore.cli.main``) in this process."""
    from ecstore import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli.main(["verify", path])
    return rc, out.getvalue()


def open_case(path: str, readonly: bool) -> str:
    """Open a (possibly damaged) store; the outcome as a short string."""
    try:
        with open_store(path, cap=16 * MiB, readonly=readonly) as s:
            n = sum(s.get(f"e{i}") is not None for i in range(20))
            return f"opened ({n} entries readable)"
    except (StoreOpenError, SchemaError) as e:
        return f"{type(e).__name__}: {e}"


def open_while_other_handle_commits(path: str, rounds: int = 120) -> int:
    """One process, two handles: handle A's writer thread commits while the
    main thread opens and closes handle B. Returns the number of opens."""
    a = open_store(path, cap=4 * MiB)
    n = 0
    for i in range(rounds):
        a.put(f"a-{i}", blob_tensor(i, 16))
        with open_store(path, cap=4 * MiB, model="other/model", dtype=torch.float16) as b:
            b.contains("nothing")
        n += 1
    a.close()
    return n


def _put_until_full(s: ECStore) -> tuple[list[int], int, str]:
    flushed: list[int] = []
    for i in range(200):
        s.put(f"full-{i}", blob_tensor(100 + i, 512))
        try:
            s.flush()
        except StoreFullError as e:
            return flushed, i, str(e)
        flushed.append(i)
    raise AssertionError("the disk never filled up")


def fill_until_full(path: str, limit_headroom: int | None, file_blob_mib: float = 4.0) -> dict:
    """Store 4 entries, then put 512 KiB entries until a flush fails.

    ``limit_headroom``: cap data.mdb's growth with RLIMIT_FSIZE at its
    current size plus this (SIGXFSZ ignored: writes fail with EFBIG); None:
    the file system itself fills up (a small tmpfs). ``file_blob_mib``: the
    store's ``min_file_blob_size`` (0: every blob in a file of its own)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    s = open_store(path, cap=256 * MiB, file_blob_mib=file_blob_mib)
    for i in range(4):
        s.put(f"pre-{i}", blob_tensor(i, 64))
    s.flush()
    if limit_headroom is not None:
        size = os.path.getsize(os.path.join(path, "data.mdb"))
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + limit_headroom, resource.RLIM_INFINITY))
    flushed, failed, error = _put_until_full(s)
    readable = all(s.get(f"full-{i}") is not None for i in flushed)
    s.put("small-after", blob_tensor(7, 4))  # small: fits in pages the file already has
    try:
        s.flush()
        small_ok = True
    except StoreFullError:
        small_ok = False
    s.close()
    return {"flushed": flushed, "failed": failed, "error": error, "readable": readable, "small_ok": small_ok}


def failed_puts_unflushed(path: str, limit_headroom: int, n: int = 24) -> dict:
    """Put ``n`` 512 KiB entries, each in a blob file of its own, under
    RLIMIT_FSIZE at data.mdb's size plus ``limit_headroom`` (SIGXFSZ
    ignored), so that they fail; wait until they are written, never flush
    (as the connector). Returns how many of the blobs the puts were copied
    into are still referenced (weak references to the pool's buffers), the
    writer's count of failed puts, and what flush then raises."""
    import gc

    from ecstore.store import writer as writer_mod
    from helpers.pool_refs import record_pool_buffers

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    bufs = record_pool_buffers(writer_mod.POOL)
    s = open_store(path, cap=256 * MiB, file_blob_mib=0.0)
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + limit_headroom, resource.RLIM_INFINITY))
    for i in range(n):
        s.put(f"full-{i}", blob_tensor(100 + i, 512))
    s.wait_committed()
    gc.collect()
    held = sum(r() is not None for r in bufs)
    failed = s._writer.write_errors
    try:
        s.flush()
        error = None
    except StoreFullError as e:
        error = str(e)
    s.close()
    return {"blobs": len(bufs), "held": held, "failed": failed, "error": error}


def ops_on_damaged_store(path: str, ident: str) -> list[str]:
    """contains/get/put/flush/delete/stats on a store whose B-tree is
    damaged: each one's outcome as "ok: <value>" or "<ExceptionType>"."""
    from ecstore import ECStoreError

    out = []
    try:
        s = open_store(path, cap=4 * MiB)
    except ECStoreError as e:
        return [f"open: {type(e).__name__}"]
    for name, call in [("contains", lambda: s.contains(ident)), ("get", lambda: s.get(ident)),
                       ("put", lambda: s.put("new-entry", blob_tensor(1, 4))), ("flush", s.flush),
                       ("delete", lambda: s.delete(ident)), ("stats", lambda: s.stats().disk_entries)]:
        try:
            v = call()
            out.append(f"{name}: ok: {v if not isinstance(v, torch.Tensor) else 'tensor'}")
        except ECStoreError as e:
            out.append(f"{name}: {type(e).__name__}")
        except Exception as e:  # the failure this test exists to catch  # noqa: BLE001
            out.append(f"{name}: FOREIGN {type(e).__module__}.{type(e).__name__}: {e}")
    try:
        s.close()
    except ECStoreError as e:
        out.append(f"close: {type(e).__name__}")
    return out


def lease_until_full(path: str, limit_bytes: int | None) -> dict:
    """Store one entry, then lease ever more keys until a lease fails.

    ``limit_bytes``: RLIMIT_FSIZE from before the store is opened (SIGXFSZ
    ignored: writes fail with EFBIG; below the lease file's map size, so it
    is not mapped writable and grows by writes); None: the file system itself
    fills up (a small tmpfs, filled by a filler file first). Returns the
    error (type, message), whether the entry still read back in this handle
    and whether the lease file was mapped writable."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if limit_bytes is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))
    s = open_store(path, cap=8 * MiB)
    s.put("kept", blob_tensor(1, 4))
    s.flush()
    if limit_bytes is None:
        _fill(os.path.join(os.path.dirname(path), "filler"))
    error: tuple[str, str] | None = None
    try:
        for r in range(2000):
            s.lease([f"key-{r}-{i}" for i in range(256)], 600)
    except Exception as e:  # noqa: BLE001 - reported: the test checks its type
        error = (type(e).__name__, str(e))
    readable = s.get("kept") is not None
    writemap = _lease_env_writemap(s)
    s.close()
    return {"error": error, "readable": readable, "writemap": writemap}


def lease_past_a_full_disk(path: str, rounds: int, fill: bool = True) -> dict:
    """Store one entry, fill the file system (a filler file; not if
    ``fill`` is False: a ramfs has no bound), then lease ``rounds`` × 256
    keys: more than the lease file held when the disk filled. Returns the
    error (type, message) if one was raised, whether the entry still reads
    back and is pinnable, and whether the lease file was mapped writable (a
    store into its map that met the full disk would be a SIGBUS: the child
    dies)."""
    s = open_store(path, cap=8 * MiB)
    s.put("kept", blob_tensor(1, 4))
    s.flush()
    size = os.path.getsize(os.path.join(path, "leases.mdb"))
    if fill:
        _fill(os.path.join(os.path.dirname(path), "filler"))
    error: tuple[str, str] | None = None
    try:
        for r in range(rounds):
            s.lease([f"key-{r}-{i}" for i in range(256)], 600)
    except Exception as e:  # noqa: BLE001 - reported: the test checks it
        error = (type(e).__name__, str(e))
    used = s.disk._shared.leases.info()["last_pgno"] * 4096
    out = {"error": error, "readable": s.get("kept") is not None, "pinned": bool(s.pin_if_present("kept")),
           "writemap": _lease_env_writemap(s), "lease_file": size, "lease_pages_used": used,
           "free": os.statvfs(path).f_bavail}
    s.close()
    return out


def _fill(filler: str) -> None:
    """Write ``filler`` until its file system is full."""
    with contextlib.suppress(OSError), open(filler, "wb") as f:
        while True:
            f.write(bytes(1 << 16))
            f.flush()


def _lease_env_writemap(s: ECStore) -> bool:
    leases = s.disk._shared.leases
    return bool(leases is not None and leases.flags()["writemap"])

