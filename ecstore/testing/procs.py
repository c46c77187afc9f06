"""Process-group inspection shared by the demo tools and their tests."""

from __future__ import annotations

import os
from pathlib import Path


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``.

    Reads ``/proc`` on Linux; elsewhere asks the kernel whether the group has
    any member at all (``[pgid]`` if so). A snapshot: processes may start or
    end right after it is taken.
    """
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
        except PermissionError:
            return [pgid]
    members = []
    for entry in proc_dir.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members
