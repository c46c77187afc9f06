"""Subprocess entry point: drive an ECStore from JSON commands.

Usage: ``python store_child.py`` (no arguments). Reads one JSON command per
line on stdin, answers one JSON line per command on stdout, in order. The
parent decides when to send what, so it can line two children up at a
barrier (send both the same phase, wait for both answers) without sleeping.

Commands (``op`` plus arguments):
  open {dir, disk_bytes, cpu_bytes?=0, model?, dtype?="bfloat16", schema_target?}
  put {id, seed, rows?=4, cols?=16}          -> {"result": bool}
  get {id, seed?, rows?, cols?}              -> {"result": "miss"|"hit"|"mismatch"}
        (with a seed the hit is compared bit for bit with make_tensor(seed,...))
  contains {id} -> bool      delete {id} -> bool      key {id} -> str
  flush      lru_keys -> [keys]      stats -> {...}
  blob_sizes -> {key: len(blob)} over every entry
  close      exit_now (os._exit(0) at once: no close, no flush)
  wait_committed
  hold_blob_syncs (from now on the blob files' fdatasync after a commit never
        returns: the state between an entry's commit and its file's sync, for
        a SIGKILL to land in)
Errors are answered as {"error": "..."} and the child keeps going.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback

import torch
from tensors import make_tensor, same_tensor

from ecstore import ECStore, ECStoreConfig
from ecstore.identity import EncoderIdentity
from ecstore.testing.stores import open_store_at_schema

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def main() -> None:
    store: ECStore | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "open":
                cpu = cmd.get("cpu_bytes", 0)
                cfg = ECStoreConfig(local_cpu=cpu > 0, max_local_cpu_size=cpu / 2**30,
                                    local_disk=cmd["dir"], max_local_disk_size=cmd["disk_bytes"] / 2**30)
                store = open_store_at_schema(cfg, cmd.get("schema_target"), model=cmd.get("model", MODEL),
                                             dtype=getattr(torch, cmd.get("dtype", "bfloat16")),
                                             identity=(EncoderIdentity.from_description(cmd["identity"])
                                          if cmd.get("identity") else None))
                result = {"pid": os.getpid(), "schema": store.disk.schema_version}
            elif op == "put":
                t = make_tensor(cmd["seed"], cmd.get("rows", 4), cmd.get("cols", 16), store.dtype)
                result = store.put(cmd["id"], t)
            elif op == "get":
                got = store.get(cmd["id"])
                if got is None:
                    result = "miss"
                elif "seed" not in cmd:
                    result = "hit"
                else:
                    want = make_tensor(cmd["seed"], cmd.get("rows", 4), cmd.get("cols", 16), store.dtype)
                    result = "hit" if same_tensor(got, want) else "mismatch"
            elif op == "contains":
                result = store.contains(cmd["id"])
            elif op == "delete":
                result = store.delete(cmd["id"])
            elif op == "key":
                result = store.key(cmd["id"])
            elif op == "flush":
                store.flush()
                result = None
            elif op == "lru_keys":
                result = store.disk.lru_keys()
            elif op == "stats":
                result = store.stats().as_dict()
            elif op == "blob_sizes":
                result = {k: len(store.disk.blob_bytes(k)) for k, _ in store.disk.iter_records()}
            elif op == "wait_committed":
                store.wait_committed()
                result = None
            elif op == "hold_blob_syncs":
                from ecstore.lmdb.blobfiles import BlobFiles

                BlobFiles.sync = lambda self, names, **kw: threading.Event().wait()  # type: ignore[method-assign]
                result = None
            elif op == "close":
                store.close()
                result = None
            elif op == "exit_now":
                sys.stdout.flush()
                os._exit(0)
            else:
                raise ValueError(f"unknown op {op!r}")
            answer = {"result": result}
        except Exception as e:  # report, keep serving  # noqa: BLE001
            answer = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
