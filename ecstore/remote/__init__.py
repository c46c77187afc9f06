"""The optional remote tier (Redis / Valkey), below memory and LMDB.

``open_remote(config, ...)`` builds a :class:`RemoteTier` from an
:class:`~ecstore.config.ECStoreConfig` with ``remote_url`` set; the ``redis``
package (``pip install 'ecstore[redis]'``) is only imported then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ecstore.remote.url import RemoteTarget, mask_secrets, parse_remote_url, supported_scheme

if TYPE_CHECKING:
    import torch

    from ecstore.remote.tier import RemoteTier

__all__ = ["RemoteTarget", "mask_secrets", "open_remote", "parse_remote_url", "supported_scheme"]


def open_remote(config: Any, *, model: str, dtype: torch.dtype, readonly: bool = False,
                clock: Callable[[], float] = time.monotonic) -> RemoteTier:
    """The remote tier ``config.remote_url`` names (ConfigError if the URL is
    malformed or the ``redis`` package is missing). Connects lazily: an
    unreachable server is not an error here."""
    from ecstore.remote.backend import RedisBackend
    from ecstore.remote.breaker import CircuitBreaker
    from ecstore.remote.tier import RemoteTier

    target = parse_remote_url(config.remote_url, config.source_of("remote_url"),
                              password=config.remote_password)
    backend = RedisBackend(target, config.remote_timeout_seconds)
    return RemoteTier(backend, model=model, dtype=dtype, timeout_s=config.remote_timeout_seconds,
                      ttl_s=config.remote_ttl_seconds, queue_bytes=config.remote_queue_bytes,
                      readonly=readonly, clock=clock, breaker=CircuitBreaker(clock=clock))
