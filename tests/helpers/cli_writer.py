"""Writer process for tests/cli/test_cli.py: puts entries in a loop until told to stop.

Usage: cli_writer.py STORE STOP_FILE MODEL

Puts small float16 [4, 8] tensors under fresh identifiers in batches, flushing
(committing) after each batch and printing ``committed N`` once per batch, until
STOP_FILE exists. Then checks that every entry it put is readable and equal,
and prints a JSON summary as its last line. Exit status 0 only if no write
failed and every entry reads back.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from ecstore import ECStore, ECStoreConfig


def tensor_for(i: int) -> torch.Tensor:
    return (torch.arange(32, dtype=torch.float32).reshape(4, 8) + i).to(torch.float16)


def main() -> int:
    store, stop_file, model = sys.argv[1:4]
    cfg = ECStoreConfig(local_cpu=False, local_disk=store, max_local_disk_size=1.0)
    puts = 0
    with ECStore(cfg, model=model, dtype=torch.float16) as s:
        while not os.path.exists(stop_file):
            for _ in range(5):
                s.put(f"writer-{puts:06d}", tensor_for(puts))
                puts += 1
            s.flush()  # raises if a write failed
            print(f"committed {puts}", flush=True)
            time.sleep(0.02)  # throttle only (2 CPUs shared with the readers)
        s.flush()
        bad = [i for i in range(puts) if not torch.equal(s.get(f"writer-{i:06d}"), tensor_for(i))]
        errors = s.stats().write_errors
    print(json.dumps({"puts": puts, "write_errors": errors, "bad": bad[:10]}), flush=True)
    return 0 if not bad and errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
