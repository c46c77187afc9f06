"""Test support shipped with ecstore (nothing in ``ecstore`` itself imports it).

* :mod:`ecstore.testing.tiny_model` -- builds a tiny random-weight BLIP-2 (no
  download) and the engine settings that run it on a CPU.
* :mod:`ecstore.testing.tiny_qwen` -- the same for tiny Qwen2.5-VL, Qwen3-VL,
  Qwen2-Audio and the Qwen2.5-Omni thinker, with their prompts and image,
  video, mp4 and audio inputs.
* :mod:`ecstore.testing.faults` -- content as a function of an id, a full
  consistency audit of a store, forkserver workers that can be SIGKILLed.
* :mod:`ecstore.testing.store_contract`, :mod:`ecstore.testing.tier_contract`
  -- the behaviour every store layout and every tier must have, as mixins to
  subclass in your own tests (run them against your own configuration);
  :mod:`ecstore.testing.tensors` -- the deterministic tensors they use.
* :mod:`ecstore.testing.stress_crash`, :mod:`ecstore.testing.stress_concurrency`
  -- the crash and concurrency stress runs; ``tools/stress_*.py`` are their
  command lines and ``tests/store/test_faults.py`` runs them with smaller
  settings. Shipped (not in tests/) because the tools and the suite share
  them, and because ``python -m ecstore.testing.stress_crash --dir DIR`` checks
  a deployment's own filesystem (SIGKILLed writers, concurrent processes).
* :mod:`ecstore.testing.stores` -- store handles opened with test seams (an
  older schema, a small LMDB map, a fake remote clock): not ECStore arguments.
* :mod:`ecstore.testing.redis_server` -- a real redis-server (single, TLS,
  unix socket, or a three-master cluster) on 127.0.0.1 for the remote tier.

The test suite and the tools share code through this package instead of
``sys.path`` edits.
"""
