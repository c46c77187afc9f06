"""A short store demo: a put, a restart (new process), and a hit.

    python tools/store_demo.py [--dir DIR]

Process 1 stores a [4096, 3584] bf16 encoder output (28 MiB) and exits;
process 2 opens the same directory, finds the entry and checks it bit-exact.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time

import torch

import ecstore

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
MM_HASH = "5f2a0c0e9d8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f"


def tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4096, 3584, generator=g).to(torch.bfloat16)


def cfg(path: str) -> ecstore.ECStoreConfig:
    return ecstore.ECStoreConfig(local_cpu=True, max_local_cpu_size=1.0, local_disk=path, max_local_disk_size=1.0)


def writer(path: str) -> None:
    with ecstore.ECStore(cfg(path), model=MODEL, dtype=torch.bfloat16) as store:
        t0 = time.perf_counter()
        store.put(MM_HASH, tensor())
        store.flush()
        print(f"[process 1] put + flush: {(time.perf_counter() - t0) * 1e3:.1f} ms, key {store.key(MM_HASH)}")


def reader(path: str) -> None:
    with ecstore.ECStore(cfg(path), model=MODEL, dtype=torch.bfloat16) as store:
        print(f"[process 2] contains: {store.contains(MM_HASH)}")
        t0 = time.perf_counter()
        got = store.get(MM_HASH)
        dt = (time.perf_counter() - t0) * 1e3
        assert got is not None and torch.equal(got.view(torch.int16), tensor().view(torch.int16))
        print(f"[process 2] get after restart: hit, {got.numel() * 2} bytes, bit-exact, {dt:.1f} ms")
        s = store.stats()
        print(f"[process 2] stats: disk entries {s.disk_entries}, disk bytes {s.disk_bytes}, hits {s.hits}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", help="store directory (default: a new temporary one)")
    ap.add_argument("--role", choices=["writer", "reader"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.role == "writer":
        return writer(a.dir)
    if a.role == "reader":
        return reader(a.dir)
    path = a.dir or tempfile.mkdtemp(prefix="ecstore-demo-")
    print(f"store directory: {path}")
    for role in ("writer", "reader"):
        subprocess.run([sys.executable, __file__, "--dir", path, "--role", role], check=True)


if __name__ == "__main__":
    main()
