"""Test support shipped with ecstore (nothing in ``ecstore`` itself imports it).

The store and tier contracts to subclass (:mod:`.store_contract`,
:mod:`.tier_contract`, with :mod:`.tensors`), the tiny model builders
(:mod:`.tiny_model`, :mod:`.tiny_qwen`), fault helpers and the audit
(:mod:`.faults`), the crash and concurrency stress runs, handles with test
seams (:mod:`.stores`) and a real redis-server (:mod:`.redis_server`). What
each holds and why it ships: docs/testing.md (the code map, #tiny-models,
#testing-your-own-configuration).
"""
