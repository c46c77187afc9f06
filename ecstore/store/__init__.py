"""The store handle (:class:`ECStore`) and its internals: the tiers it holds
(``tiers``), the read and put paths, the background writer, the calls in
flight and the counters. Everything above (connector, maintenance, CLI)
talks to :class:`ECStore`, never to a tier directly.
"""

from ecstore.store.handle import ECStore, StoreStats

__all__ = ["ECStore", "StoreStats"]
