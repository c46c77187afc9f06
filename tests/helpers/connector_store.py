"""The store behind a test's connector, opened as another process would.

Shared by the connector tests (tests/connector/test_connector_unit.py,
tests/connector/test_connector_scheduler.py, tests/connector/test_remote_connector.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ecstore import ECStore
from ecstore.connector import ECStoreConnector


def open_store(conn: ECStoreConnector) -> ECStore:
    """A handle on ``conn``'s store under its encoder identity (no memory
    tier: what it reads and writes is the shared file, or the remote)."""
    return ECStore(replace(conn.config, local_cpu=False), model=conn._vllm_config.model_config.model,
                   dtype=torch.float32, identity=conn.identity)


def damage_blob(conn: ECStoreConnector, identifier: str) -> None:
    """Flip the last byte of ``identifier``'s stored blob, its record
    unchanged (the checksum no longer matches)."""
    with open_store(conn) as st:
        key = st.key(identifier)
        blob = bytearray(st.disk.blob_bytes(key))
        blob[-1] ^= 0xFF
        with st.disk.env.begin(write=True) as txn:
            txn.put(key.encode(), bytes(blob), db=st.disk._dbs.blobs)
