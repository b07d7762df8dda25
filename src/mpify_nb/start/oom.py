"""Was a rank killed by the out-of-memory killer, or by a signal someone sent? Its cgroup counts.

A SIGKILL says nothing of who sent it. The memory cgroup a process belongs to counts the processes
the OOM killer killed in it (any kind: the cgroup's limit, or the whole machine's memory)::

    cgroup v2   /proc/<pid>/cgroup "0::<path>"           <root>/<path>/memory.events       oom_kill N
    cgroup v1   /proc/<pid>/cgroup "<n>:memory:<path>"   <root>/memory/<path>/memory.oom_control  oom_kill N

Read when a rank starts and again once it died of SIGKILL: the count rose (the OOM killer, most
likely of it: another process of its cgroup is possible, and said), or it did not (a signal sent
by hand or by another process). Where no count can be read (no memory cgroup, a container that
hides it), nothing is claimed either way.
"""

from __future__ import annotations

import os
from typing import Optional


class OomKills:
    """The OOM-kill count of one memory cgroup."""

    def __init__(self, path: str):
        self.path = path  # its memory.events (v2) or memory.oom_control (v1)

    @classmethod
    def of(cls, pid: int, proc: str = "/proc", root: str = "/sys/fs/cgroup") -> Optional[OomKills]:
        """The count of ``pid``'s memory cgroup (None where none can be read)."""
        try:
            with open(os.path.join(proc, str(pid), "cgroup")) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        candidates = []
        for line in lines:
            number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
            path = path.lstrip("/")
            if number == "0" and controllers == "":  # v2: one hierarchy
                candidates += [os.path.join(root, path, "memory.events"), os.path.join(root, "memory.events")]
            elif "memory" in controllers.split(","):  # v1: the memory controller's hierarchy
                candidates += [os.path.join(root, "memory", path, "memory.oom_control"),
                               os.path.join(root, "memory", "memory.oom_control")]  # a namespaced mount
        for candidate in candidates:
            counter = cls(candidate)
            if counter.read() is not None:
                return counter
        return None

    def read(self) -> Optional[int]:
        """The count now (None if it cannot be read)."""
        try:
            with open(self.path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return None


class OomWatch:
    """A rank's cgroup count, read when it starts; ``cause()`` of its SIGKILL once it is dead."""

    def __init__(self, pid: int, proc: str = "/proc", root: str = "/sys/fs/cgroup"):
        self.counter = OomKills.of(pid, proc, root)
        self.before = self.counter.read() if self.counter is not None else None

    def cause(self) -> str:
        """Who killed it (SIGKILL), as the count says; "" when it cannot say."""
        if self.counter is None or self.before is None:
            return ""
        after = self.counter.read()
        if after is None:
            return ""
        where = os.path.basename(self.counter.path)
        if after > self.before:
            return (f"by the out-of-memory killer: its cgroup's oom_kill count ({where}) rose from {self.before} to "
                    f"{after} while it ran (another process of its cgroup may have been the one); it, or what ran "
                    f"beside it, needed more memory than the machine, or the cgroup's limit, allows")
        return (f"killed by a signal sent by hand or by another process, not the OOM killer: its cgroup's "
                f"oom_kill count ({where}) stayed at {after}")
