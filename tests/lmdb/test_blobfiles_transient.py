"""A blob file that cannot be opened for a transient reason (the process is
out of file descriptors) is a miss for that read only: the entry is valid,
so it must be neither dropped nor its file deleted."""

from __future__ import annotations

import os
import resource

import torch

from ecstore.format import PendingPut, PutOutcome
from ecstore.lmdb import BatchPut, LMDBTier
from ecstore.testing.tier_contract import KEY_A, NAME_A, tensor

MiB = 1 << 20


def test_too_many_open_files_is_a_miss_that_keeps_the_entry(tmp_path):
    tier = LMDBTier(str(tmp_path / "store"), 16 * MiB, file_blobs_from=0)
    try:
        t = tensor(1, rows=64, cols=64)
        p = BatchPut(PendingPut(KEY_A, NAME_A, t), "org/model")
        tier.write_batch([p])
        assert p.outcome is PutOutcome.STORED
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.open(os.devnull, os.O_RDONLY)
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))  # no descriptor is left
        try:
            assert tier.get(KEY_A, NAME_A) is None  # cannot be read now: a miss
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert tier.identifier_at(KEY_A) == NAME_A, "a valid entry was dropped for EMFILE"
        got = tier.get(KEY_A, NAME_A)
        assert got is not None and torch.equal(got.view(torch.int16), t.view(torch.int16))
    finally:
        tier.close()
