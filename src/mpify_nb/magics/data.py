"""Data to and from the ranks: %dist_push, %dist_pull, %sync.

::

    %dist_push a b ──> Session.push: the notebook's a and b, defined on every rank
    %dist_pull x [--rank k | --all] <── Session.pull: a rank's x (or every rank's, a list)
    %sync ──> every rank idle, CUDA synchronized, a barrier on the group (rank/cells.py)
"""

from __future__ import annotations

import functools
import shlex
from typing import Any

from ..rank import cells as on_ranks
from .cell import rank_list
from .state import SessionState, usage


@functools.cache
def data_magics_class() -> type:
    """Build the Magics class (on first use, not at import)."""
    from IPython.core.magic import Magics, line_magic, magics_class

    @magics_class
    class DataMagics(Magics):
        """%dist_push, %dist_pull, %sync: values to and from the ranks."""

        def __init__(self, shell: Any, state: SessionState):
            super().__init__(shell)
            self.state = state
            self._sh: Any = shell  # IPython's shell (never None once registered)

        @line_magic
        def dist_push(self, line: str) -> None:
            """Copy notebook variables to every rank (replacing what a rank had under those names).
            Big tensors and arrays travel through shared memory.

            Example::

                %dist_push weights config
            """
            s = self.state.require("dist_push")
            names = line.split()
            if not names:
                raise usage("dist_push", "name at least one notebook variable", "%dist_push a [b ...]")
            missing = [n for n in names if n not in self._sh.user_ns]
            if missing:
                raise usage("dist_push", f"the notebook has no {', '.join(map(repr, missing))}")
            self.state.call(lambda: s.push(None, **{n: self._sh.user_ns[n] for n in names}))
            print(f"Sent {', '.join(names)} to ranks {rank_list(range(s.world_size))}.")

        @line_magic
        def dist_pull(self, line: str) -> None:
            """Bring a rank's variable into the notebook (``--rank k``, default 0), or every
            rank's as a list by rank (``--all``).

            Example::

                %dist_pull loss --all      # loss == [loss on rank 0, loss on rank 1]
            """
            s = self.state.require("dist_pull")
            try:
                words = shlex.split(line)
            except ValueError as e:
                raise usage("dist_pull", str(e)) from None
            names, rank, every = [], 0, False
            i = 0
            while i < len(words):
                word = words[i]
                if word in ("--all", "-a"):
                    every = True
                elif word in ("--rank", "-r") or word.startswith("--rank="):
                    value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else "")
                    i += 0 if "=" in word else 1
                    if not value.isdigit() or int(value) >= s.world_size:
                        raise usage("dist_pull", f"--rank takes a rank 0..{s.world_size - 1}, not {value!r}",
                                    "%dist_pull x [--rank k | --all]")
                    rank = int(value)
                elif word.startswith("-"):
                    raise usage("dist_pull", f"unknown option {word}", "%dist_pull x [--rank k | --all]")
                else:
                    names.append(word)
                i += 1
            if not names:
                raise usage("dist_pull", "name a variable of the ranks", "%dist_pull x [--rank k | --all]")
            for name in names:
                value = self.state.call(lambda name=name: s.pull(name, rank=None if every else rank))
                self._sh.user_ns[name] = value
            print(f"{', '.join(names)} <- " + ("every rank (a list by rank)" if every else f"rank {rank}"))

        @line_magic
        def sync(self, line: str) -> None:
            """Wait until every rank is idle, then a barrier on the group (and CUDA work done).

            Example::

                %sync
            """
            s = self.state.require("sync")
            groups = self.state.call(lambda: s.apply(on_ranks.group_state, timeout=self.state.timeout))
            ranks = rank_list(range(s.world_size))  # every rank is idle now
            without = [r for r, g in sorted(groups.items()) if g == "none"]
            if without:  # a barrier would wait for ranks that cannot join one: say so instead
                restart = "; %dist_restart brings the Session's group back" if s.ddp else ""
                who = "they have" if len(without) == len(groups) else \
                    f"{rank_list(without)} {'has' if len(without) == 1 else 'have'}"
                print(f"ranks {ranks} idle, not synchronized: {who} no process group{restart}")
                return
            self.state.call(lambda: s.apply(on_ranks.sync, timeout=self.state.timeout))
            own = " (a barrier on the group a cell made)" if set(groups.values()) == {"own"} else ""
            print(f"ranks {ranks} in sync{own}")

    return DataMagics
