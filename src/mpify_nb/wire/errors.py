"""Where errors come back: the exceptions a failed call raises, and the remote
traceback that travels from a rank to the caller.

Two ways a rank can fail, as in ``torch.multiprocessing.spawn``:

* ``RankRaisedError``: the rank's code raised. It carries the remote traceback
  (with the user's own source lines, filled in from the caller's linecache, where
  notebook cells live) and, when it could be sent, the original exception as
  ``__cause__``.
* ``RankExitedError``: the rank's process ended without answering (killed by a
  signal, segfault, OOM killer, ``os._exit``).

Both derive from ``RankError`` (a ``RuntimeError``) and name the rank.

A :class:`~mpify_nb.Session` (persistent ranks) adds two more:

* ``CollectiveError``: some ranks waited in a collective (``all_reduce``...) that
  other ranks never joined (they were idle, or had raised); the group was rebuilt.
* ``SessionClosedError``: the session was closed, so there is nothing to run on.

and :func:`merge_rank_errors`, which reports the same error raised by several ranks
once, naming the list of ranks, and different errors each with its ranks.
"""

from __future__ import annotations

import copyreg
import linecache
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

from . import notes
from .notes import safe_str as safe_str  # where the rest of mpify_nb imports it from

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mpify_nb/, above wire/


class RankError(RuntimeError):
    """A rank of a ``ranch`` call failed.

    Attributes:
        rank: the rank that failed first (the root cause, not the ranks that
            failed because a peer disappeared).
        others: the other failures seen during the same call, as ``RankError``s.

    ``RankRaisedError`` (the function raised, or its value could not be sent back) and
    ``RankExitedError`` (the process died) are its kinds: catch ``RankError`` for both.

    Example (a notebook cell): a value that cannot travel back to the notebook.

    ```python
    from mpify_nb import ranch, RankError

    def numbers():
        return (i for i in range(3))       # a generator: rank 1 cannot pickle it

    try:
        ranch(2, numbers)
    except RankError as e:
        print(type(e).__name__, e.rank)
        print(str(e).splitlines()[0])
    ```

    ```output
    RankRaisedError 1
    rank 1 raised RuntimeError: the value returned by rank 1 (generator) cannot be pickled: ...
    ```
    """

    def __init__(self, rank: int, message: str, when: Optional[float] = None):
        super().__init__(message)
        self.rank = rank
        #: every rank this error stands for (several when identical errors were merged)
        self.ranks: list[int] = [rank]
        self.others: list[RankError] = []
        #: raised inside a collective: what the rank waited in then (a torchdist.waits.Snapshot)
        self.context: Any = None
        # time.monotonic() when it failed (the same clock in every process of this machine):
        # of several failures, the earliest is the root cause.
        self.when = time.monotonic() if when is None else when

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing the local traceback, which would
        # only show library internals: the remote one is what the user needs. The type
        # leads, as in every error a cell shows: it is what an `except` clause names.
        lines = str(self).splitlines() or [""]
        return [f"{type(self).__name__}: {lines[0]}", *lines[1:]]


class RankRaisedError(RankError):
    """The function raised an exception on ``rank``.

    ``exc_type`` is the remote exception's qualified type name, ``remote_traceback``
    the formatted remote traceback; ``__cause__`` is the original exception when it
    could be carried back.

    Example (a notebook cell):

    ```python
    import os
    from mpify_nb import ranch, RankRaisedError

    def check():
        if os.environ["RANK"] == "1":
            raise KeyError("label")
        return "ok"

    try:
        ranch(2, check)
    except RankRaisedError as e:
        print(e.rank, e.exc_type, repr(e.__cause__))
        print(e.remote_traceback.splitlines()[-1])
    ```

    ```output
    1 KeyError KeyError('label')
    KeyError: 'label'
    ```
    """

    def __init__(self, rank: int, exc_type: str, exc_message: str, remote_traceback: str,
                 when: Optional[float] = None, ranks: Optional[list[int]] = None):
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        who = f"rank {rank}" if not ranks or len(ranks) == 1 else f"ranks {sorted(ranks)}"
        head = f"{who} raised {exc_type}: {exc_message}" if exc_message else f"{who} raised {exc_type}"
        super().__init__(rank, f"{head}\n\n--- traceback from {who} ---\n{remote_traceback.rstrip()}", when)
        if ranks:
            self.ranks = sorted(ranks)


class RankExitedError(RankError):
    """The process of ``rank`` ended without sending back a result.

    ``exitcode`` is the exit status (``None`` when unknown), ``signal_name`` the
    signal that killed it, if any. ``recovery``, when given, is a line that says what
    brings the rank back (a Session's restart).

    Example (a notebook cell): rank 1 is killed, as the OOM killer would.

    ```python
    import os, signal
    from mpify_nb import ranch, RankExitedError

    def work():
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return "done"

    try:
        ranch(2, work)
    except RankExitedError as e:
        print(e.rank, e.signal_name, e.exitcode)
    ```

    ```output
    1 SIGKILL -9
    ```
    """

    def __init__(self, rank: int, exitcode: Optional[int], detail: str = "", recovery: str = "",
                 killed_by: str = ""):
        self.exitcode = exitcode
        self.signal_name: Optional[str] = None
        if exitcode is not None and exitcode < 0:
            try:
                self.signal_name = signal.Signals(-exitcode).name
            except ValueError:
                self.signal_name = f"signal {-exitcode}"
            how = f"was killed by {self.signal_name}"
            if self.signal_name == "SIGKILL":  # its cgroup's OOM count may say which (start/oom.py)
                how += f" ({killed_by})" if killed_by else " (killed by hand, or by the kernel's out-of-memory killer)"
            elif self.signal_name == "SIGSEGV":
                how += " (a segmentation fault, usually in a C extension)"
            elif self.signal_name == "SIGABRT":
                how += (" (an abort in C++ code, e.g. gloo's check that a collective's tensors match: "
                        "the rank printed why on its stderr)")
        elif exitcode is not None:
            how = f"exited with code {exitcode} without returning a result"
        else:
            how = "ended without returning a result"
        msg = f"rank {rank} {how}"
        if detail:
            msg += f": {detail}"
        if recovery:
            msg += f"\n{recovery}"
        super().__init__(rank, msg)


class CollectiveError(RankError):
    """The ranks called collectives that cannot match, found before any entered them (the
    collective check); or ranks waited in collectives that can never finish: one that other ranks
    never joined, or that cannot match, each receiving from the other. Raised by a
    :class:`~mpify_nb.Session` and ``ranch`` (every rank stopped), and on a rank by the check.

    Attributes:
        waiting: the ranks that were blocked (the check's: the ranks of the group).
        missing: the ranks that never joined (idle, finished, returned, or failed: see ``errors``).
        errors: what the missing ranks raised meanwhile, if anything (``RankRaisedError``s).
        rebuilt: True when the process group was rebuilt (the next collective works); False when
            not (the check's: no rank entered it, the group works); None for ``ranch``.
        kind: "absent", "mismatch", "wrong value" or "deadlock".
        culprit: for "wrong value", the rank that returned from the collective with a wrong value.
        after: what became of the ranks (default: from ``rebuilt``); mismatch: the check's calls.

    A Session keeps every rank's Python state; re-create what was made on a rebuilt group (DDP).

    Example (a notebook cell): rank 0 calls ``all_reduce`` alone.

    ```python
    from mpify_nb import Session
    from mpify_nb.errors import CollectiveError

    with Session(2) as s:
        try:
            s.run("t = torch.ones(1); dist.all_reduce(t)", ranks=[0])
        except CollectiveError as e:
            print("missing", e.missing, "rebuilt", e.rebuilt)
        print(s.run("t = torch.ones(1); dist.all_reduce(t); t.item()"))   # every rank joins
    ```

    ```output
    missing [1] rebuilt True
    {0: 2.0, 1: 2.0}
    ```
    """

    def __init__(self, waiting: list[int], missing: list[int], op: str = "a collective",
                 errors: Optional[list[RankError]] = None, rebuilt: Optional[bool] = True,
                 what: str = "", kind: str = "absent", culprit: Optional[int] = None,
                 after: Optional[str] = None):
        self.waiting = sorted(waiting)
        self.missing = sorted(missing)
        self.op = op
        self.errors = list(errors or [])
        self.rebuilt = rebuilt
        self.kind = kind
        self.culprit = culprit
        after = after or ("every rank was stopped" if rebuilt is None else
                          "the process group was rebuilt (Python state kept; re-create objects made on the "
                          "old group, e.g. DistributedDataParallel)" if rebuilt else "the process group is broken")
        if what:
            msg = f"{what}; {after}"
        else:
            who = _rank_list(self.waiting)
            verb = "was" if len(self.waiting) == 1 else "were"
            msg = f"{who} {verb} left waiting in {op}, which {_rank_list(self.missing)} never joined; {after}"
        if self.errors:  # the root cause first: what the missing ranks raised, each distinct error once
            msg = f"{merge_rank_errors(self.errors)}\n\nMeanwhile {msg}"
        root = (self.errors[0].rank if self.errors else culprit if culprit is not None
                else self.missing[0] if self.missing else self.waiting[0] if self.waiting else 0)
        super().__init__(root, msg)
        self.ranks = self.missing or self.waiting
        self.mismatch: Any = None  # the check's: a torchdist.checks.mismatch.Mismatch

    def __reduce__(self) -> Any:  # its __init__ takes the parts: a rank's travels as its state
        return copyreg.__newobj__, (type(self), *self.args), dict(self.__dict__)  # type: ignore[attr-defined]


class StdinUnavailableError(RuntimeError):
    """Raised on a rank that reads its stdin (``input()``, pdb) when the notebook cannot
    answer: its frontend does not allow input (``allow_stdin=False``, papermill without it).

    It reaches the notebook as that rank's ``RankRaisedError``, whose ``exc_type`` names it.

    Example (a notebook cell, run by nbclient or papermill, which allow no input; in
    JupyterLab the same cell asks you for rank 1's answer):

    ```python
    import os
    from mpify_nb import ranch, RankRaisedError

    def ask():
        return input("learning rate? ") if os.environ["RANK"] == "1" else None

    try:
        ranch(2, ask)
    except RankRaisedError as e:
        print(e.exc_type)
    ```

    ```output
    mpify_nb.wire.errors.StdinUnavailableError
    ```
    """


class SessionClosedError(RuntimeError):
    """The :class:`~mpify_nb.Session` is closed: start a new one (``%dist_init`` in a notebook).

    Raised by a call on a closed Session, and by a call that was running when another thread
    closed it. Its ranks are gone; nothing of theirs is left running.

    Example (a notebook cell):

    ```python
    from mpify_nb import Session
    from mpify_nb.errors import SessionClosedError

    s = Session(2)
    s.close()
    try:
        s.run("rank")
    except SessionClosedError as e:
        print(e)
    ```

    ```output
    this Session is closed; start a new one
    ```
    """


def merge_rank_errors(errors: list[RankError]) -> RankError:
    """One error for several ranks' failures, showing each distinct one with its ranks:
    identical ``RankRaisedError``s (same type, message and traceback) become one that names
    the list of ranks. Of different errors the earliest is raised (its type is what the cell
    fails with); the others are in its ``.others``, and its message shows them after its own.

    >>> e = merge_rank_errors([err_rank0, err_rank1])   # both raised NameError('t')
    >>> e.ranks
    [0, 1]
    >>> print(merge_rank_errors([value_error_rank0, key_error_rank1]))
    rank 0 raised ValueError: ...
    ...
    rank 1 raised KeyError: ...
    """
    if not errors:
        raise ValueError("merge_rank_errors needs at least one error")
    alike: dict[object, list[RankError]] = {}
    for e in sorted(errors, key=lambda e: e.rank):
        key = (e.exc_type, e.exc_message, e.remote_traceback) if isinstance(e, RankRaisedError) else id(e)
        alike.setdefault(key, []).append(e)
    distinct = sorted((_merge_identical(group) for group in alike.values()), key=lambda e: e.when)
    if len(distinct) == 1:
        return distinct[0]
    root, others = distinct[0], distinct[1:]
    # A copy: a Session raises a dead rank's error again in later calls, alone or with others.
    shown = type(root).__new__(type(root))
    shown.__dict__.update(vars(root))
    shown.__cause__ = root.__cause__
    shown.args = ("\n\n".join(str(e) for e in distinct),)
    shown.others = others
    return shown


def _merge_identical(group: list[RankError]) -> RankError:
    if len(group) == 1:
        return group[0]
    first = group[0]
    assert isinstance(first, RankRaisedError)
    merged = RankRaisedError(first.rank, first.exc_type, first.exc_message, first.remote_traceback,
                             when=min(e.when for e in group), ranks=[e.rank for e in group])
    merged.__cause__ = first.__cause__
    return merged


def _rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks}"


class PayloadError(TypeError):
    """Something passed to ``ranch`` cannot be sent to the ranks (raised before any rank starts),
    or a value a ``Session`` pulls from a rank cannot be brought back. The message names it.

    Example (a notebook cell):

    ```python
    from mpify_nb import ranch, PayloadError

    numbers = (i for i in range(3))      # a generator cannot be pickled
    try:
        ranch(2, sum, numbers)
    except PayloadError as e:
        print(type(e).__mro__[1].__name__, "naming", "argument" in str(e))
    ```

    ```output
    TypeError naming True
    ```
    """


# -- the remote traceback --------------------------------------------------------------

@dataclass
class RemoteFailure:
    """What a rank sends back when its code raised: plain data, always picklable."""

    exc_type: str
    exc_message: str
    frames: list[tuple[str, int, str, Optional[str]]]  # filename, lineno, function, source line
    chain: str = ""  # formatted "During handling..." / "The above exception..." part
    exception_blob: Optional[bytes] = field(default=None, repr=False)  # the pickled exception
    when: float = field(default_factory=time.monotonic)
    #: raised inside a collective: the rank's torchdist.waits.Snapshot then (what it waited in, where)
    context: Any = field(default=None, repr=False)

    @classmethod
    def capture(cls, exc: BaseException, dumps) -> RemoteFailure:
        notes.with_hint(exc)
        te = traceback.TracebackException.from_exception(exc, capture_locals=False)
        frames = [(f.filename, f.lineno or 0, f.name, f.line or None) for f in te.stack]
        chain = ""
        cause = te.__cause__ or (None if te.__suppress_context__ else te.__context__)
        if cause is not None:
            chain = "".join(cause.format()) + (
                "\nThe above exception was the direct cause of the following exception:\n\n"
                if te.__cause__ is not None
                else "\nDuring handling of the above exception, another exception occurred:\n\n"
            )
        try:
            blob = dumps(exc)
        except Exception:
            blob = None
        return cls(_qualified_name(type(exc)), notes.with_notes(exc), frames, chain, blob)

    def format(self) -> str:
        """Format like Python does, with source lines taken from this process's linecache
        when the rank had none (cells of a notebook exist only in the kernel's linecache)."""
        lines = [self.chain, "Traceback (most recent call last):\n"]
        for filename, lineno, name, line in _user_frames(self.frames):
            if not line:
                line = linecache.getline(filename, lineno).strip() or None
            lines.append(f"  {source_location(filename)}, line {lineno}, in {name}\n")
            if line:
                lines.append(f"    {line}\n")
        tail = f"{self.exc_type}: {self.exc_message}" if self.exc_message else self.exc_type
        lines.append(tail + "\n")
        return "".join(lines)

    def to_error(self, rank: int, loads) -> RankRaisedError:
        err = RankRaisedError(rank, self.exc_type, self.exc_message, self.format(), self.when)
        err.context = self.context
        if self.exception_blob is not None:
            try:
                original = loads(self.exception_blob)
            except Exception:
                original = None
            if isinstance(original, BaseException):
                err.__cause__ = original
        return err


def _qualified_name(tp: type) -> str:
    module = getattr(tp, "__module__", "builtins")
    if module in ("builtins", "__main__"):
        return tp.__qualname__
    return f"{module}.{tp.__qualname__}"


def _user_frames(frames):
    """Drop the library's own frames that lead into the user's code: the user never
    called them, and they only push the interesting lines out of sight."""
    start = 0
    while start < len(frames) and _is_library_file(frames[start][0]):
        start += 1
    return frames[start:] if start < len(frames) else frames


def _is_library_file(filename: str) -> bool:
    """A file of this package or of one of its subpackages (magics/)."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def source_location(filename: str) -> str:
    # ipykernel names cells /tmp/ipykernel_<pid>/<hash>.py; IPython shows them as "Cell In[n]".
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None and hasattr(ip, "compile"):
            fmt = getattr(ip.compile, "format_code_name", None)
            if fmt is not None:
                named = fmt(filename)
                if named:
                    return f"{named[0]} {named[1]}"
    except Exception:
        pass
    return f'File "{filename}"'
