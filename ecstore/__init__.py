"""ecstore: an embedded, persistent cache for multimodal encoder outputs in vLLM.

Public API::

    cfg = ecstore.ECStoreConfig(local_cpu=True, max_local_cpu_size=2.0,
                                local_disk="/var/lib/ec", max_local_disk_size=16.0)
    with ecstore.ECStore(cfg, model="Qwen/Qwen2.5-VL-7B-Instruct", dtype=torch.bfloat16) as store:
        store.put(mm_hash, tensor); store.get(mm_hash); store.contains(mm_hash)

The vLLM connector lives in :mod:`ecstore.connector` (imports vLLM lazily).
"""

from ecstore.config import ConfigWarning, ECStoreConfig, describe_config, load_config
from ecstore.errors import (
    ConfigError,
    CorruptEntryError,
    ECStoreError,
    ForkedStoreError,
    InvalidEntryError,
    SchemaError,
    StoreFullError,
    StoreOpenError,
)
from ecstore.key import ECKey, chunk_hash, make_key, parse_key
from ecstore.store import ECStore, StoreStats

__version__ = "0.1.0"

__all__ = [
    "ECStore",
    "ECStoreConfig",
    "StoreStats",
    "load_config",
    "describe_config",
    "ConfigWarning",
    "ECKey",
    "chunk_hash",
    "make_key",
    "parse_key",
    "ECStoreError",
    "ConfigError",
    "InvalidEntryError",
    "SchemaError",
    "StoreFullError",
    "StoreOpenError",
    "ForkedStoreError",
    "CorruptEntryError",
]
