"""A lease that meets a full disk says so, or never meets it: the store is intact.

The lease file (``leases.mdb``) is mapped writable where its blocks can be
reserved up to its map size first (ext4, XFS, tmpfs with the space; no file
size limit below it): it never grows on disk, so a full disk never reaches a
lease (a store into a writable map that met one would be a SIGBUS). Elsewhere
it grows by writes as leases are taken; when its file system is full (a real
small tmpfs, where this process may mount) or a file size limit is reached
(RLIMIT_FSIZE, everywhere), LMDB's commit fails. That was reported as "LMDB
error ... the store may be damaged: check it with ecstore-dump verify"
although nothing was damaged (the commit was not made).
"""

from __future__ import annotations

import contextlib
import os

import pytest
from helpers import fault_fs
from helpers import fault_workers as fw

from ecstore.lmdb.env import LEASE_MAP_SIZE
from ecstore.testing import faults as fc

FULL = ["rlimit-fsize"] + (["tmpfs-enospc"] if fault_fs.can_mount() else [])
needs_mount = pytest.mark.skipif(not fault_fs.can_mount(), reason="needs to mount a tmpfs or ramfs (root)")


@pytest.mark.parametrize("how", FULL)
def test_a_lease_on_a_full_disk_is_a_disk_full_error_and_the_store_is_intact(tmp_path, how):
    if how == "rlimit-fsize":  # below the map size: the lease file cannot be reserved, so it grows
        mount, path, limit, why = contextlib.nullcontext(), tmp_path / "s", 1 << 20, "RLIMIT_FSIZE"
    else:  # too small to reserve the lease file's map
        mount, path, limit, why = (fault_fs.small_tmpfs(tmp_path / "mnt", 4 << 20), tmp_path / "mnt" / "s",
                                   None, "No space left on device")
    with mount:
        r = fc.run_forked(fw.lease_until_full, str(path), limit, timeout=300).ok()
        assert not r["writemap"]
        assert r["error"] is not None, "the leases never filled the disk"
        kind, message = r["error"]
        assert kind == "StoreFullError", r["error"]
        assert message.startswith("disk full while writing to store") and why in message, message
        assert "damaged" not in message and "intact" in message, message
        assert r["readable"]  # the handle kept working
        if how != "rlimit-fsize":
            os.unlink(tmp_path / "mnt" / "filler")
        assert fc.run_verify_cli(path).returncode == 0  # what the message says: nothing is damaged
        with fw.open_store(path, cap=8 * fw.MiB) as s:
            assert s.get("kept") is not None
            assert s.pin_if_present("kept")


@needs_mount
def test_a_lease_file_mapped_writable_takes_leases_past_a_full_disk(tmp_path):
    """Its blocks were reserved at open: leases filling far more of the file
    than it held when the disk filled are all taken (no error, no SIGBUS:
    ``run_forked`` fails on a child killed by a signal)."""
    with fault_fs.small_tmpfs(tmp_path / "mnt", LEASE_MAP_SIZE + (16 << 20)):
        path = tmp_path / "mnt" / "s"
        r = fc.run_forked(fw.lease_past_a_full_disk, str(path), 120, timeout=300).ok()
        assert r["writemap"], r
        assert r["free"] == 0, r  # the file system was full throughout
        assert r["error"] is None, r
        assert r["lease_pages_used"] > 4 << 20, r  # 30 k leases: megabytes of the reserved file
        assert r["readable"] and r["pinned"], r
        os.unlink(tmp_path / "mnt" / "filler")
        assert fc.run_verify_cli(path).returncode == 0


@needs_mount
def test_a_lease_file_is_not_mapped_writable_where_its_blocks_cannot_be_reserved(tmp_path):
    """ramfs has no fallocate: the lease file grows by writes, as before."""
    with fault_fs.ramfs(tmp_path / "mnt"):
        path = tmp_path / "mnt" / "s"
        r = fc.run_forked(fw.lease_past_a_full_disk, str(path), 1, False, timeout=300).ok()
        assert not r["writemap"] and r["error"] is None and r["readable"] and r["pinned"], r
