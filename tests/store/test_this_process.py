"""THIS_PROCESS.pid (the hot path's fork checks read it, not os.getpid())
is the forked child's own id in a child."""

from __future__ import annotations

import os

from ecstore.errors import THIS_PROCESS


def test_this_process_pid_is_the_forked_childs_own() -> None:
    assert THIS_PROCESS.pid == os.getpid()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report both ids, then leave at once
        try:
            os.write(w, f"{THIS_PROCESS.pid} {os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        seen, actual = f.read().split()
    os.waitpid(child, 0)
    assert seen == actual == str(child)
    assert THIS_PROCESS.pid == os.getpid() != child
