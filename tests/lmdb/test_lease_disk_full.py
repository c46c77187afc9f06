"""A lease that meets a full disk says so: the store is intact.

The lease file (``leases.mdb``) grows as leases are taken; when its file
system is full (a real small tmpfs, where this process may mount) or a file
size limit is reached (RLIMIT_FSIZE, everywhere), LMDB's commit fails. That
was reported as "LMDB error ... the store may be damaged: check it with
ecstore-dump verify" although nothing was damaged (the commit was not made).
"""

from __future__ import annotations

import contextlib
import os

import pytest
from helpers import fault_fs
from helpers import fault_workers as fw

from ecstore.testing import faults as fc

FULL = ["rlimit-fsize"] + (["tmpfs-enospc"] if fault_fs.can_mount() else [])


@pytest.mark.parametrize("how", FULL)
def test_a_lease_on_a_full_disk_is_a_disk_full_error_and_the_store_is_intact(tmp_path, how):
    if how == "rlimit-fsize":
        mount, path, headroom, why = contextlib.nullcontext(), tmp_path / "s", 256 << 10, "RLIMIT_FSIZE"
    else:
        mount, path, headroom, why = (fault_fs.small_tmpfs(tmp_path / "mnt", 4 << 20), tmp_path / "mnt" / "s",
                                      None, "No space left on device")
    with mount:
        r = fc.run_forked(fw.lease_until_full, str(path), headroom, timeout=300).ok()
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
