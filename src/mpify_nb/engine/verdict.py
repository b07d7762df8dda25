"""What the ranks' snapshots mean: a call that can never finish, and why; where everyone is.

The caller's watch (engine/watch.py) looks at every rank of a call (torchdist/waits.py: a
:class:`Snapshot` each) and asks :func:`judge`. Every rule is about what the ranks wait in,
never about how long they have waited (time only decides when the watch looks, and when a
rank that returned is surely gone from a wait nothing numbers: ``settled``)::

    mismatch     two ranks hold the same collective number of a group (the recorder's), one
                 of them waiting in it, and the two cannot be one collective: another op,
                 other sizes or dtypes, another src/dst. If the other one returned from it,
                 it got a wrong value.
    absent       a rank waits in a collective of a group one of whose ranks left (returned
                 from fn, idle, finished the cell, raised, died) without issuing it; in a send
                 or recv whose peer left without making its part (counted per peer). A wait
                 nothing numbers (gloo before torch 2.8, a wait seen by its frame alone) cannot
                 tell: it counts only peers that left a while before the look (``settled``).
    deadlock     ranks blocked in torch.distributed calls, the same in two looks in a row,
                 none of which any rank can ever match: each receives from the other, each
                 sends, another tag, or each waits for a rank blocked elsewhere.
    returned     (every rank returned: :func:`judge_returned`) two ranks completed the same
                 collective number of a group with tensors that cannot be one collective:
                 gloo lets a broadcast into a bigger buffer pass, and the receiver holds a
                 wrong value.

:func:`ops_text` and :func:`where_text` say it in words, with the cell's lines.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Optional

from ..torchdist import compat
from ..torchdist.recorder import ROOTED, Op, numel, op_text, p2p_apart, pairs, shown_tensors, why_apart
from ..torchdist.waits import Snapshot
from ..wire.errors import source_location

#: Why a rank left a call, as ``absent`` says it: the two that leave having done their part, the
#: ones after which a waking peer is no news (a rank that raised or died fails the call anyway).
RETURNED = "returned from fn"
FINISHED = "finished the cell"
LEFT_DONE = frozenset({RETURNED, FINISHED})


@dataclass
class Verdict:
    """A call that cannot finish: ``kind`` is "mismatch", "wrong value", "absent" or "deadlock";
    ``waiting`` the ranks left waiting, ``missing`` (absent) those that never joined;
    ``what`` says it (per rank: where, which op), ``label`` (absent) what they wait in, as called."""

    kind: str
    waiting: list[int]
    missing: list[int] = field(default_factory=list)
    what: str = ""
    label: str = ""
    culprit: Optional[int] = None  # "wrong value": the rank that got one


def judge(snaps: dict[int, Snapshot], world: int, absent: dict[int, str],
          previous: Optional[dict[int, Snapshot]] = None,
          settled: Optional[Collection[int]] = None) -> Optional[Verdict]:
    """The verdict on the ranks' latest looks (``snaps``; those of ``absent`` ranks are their
    last, a returned rank's included), or None while the call can still finish.
    ``absent``: {rank: why it will issue nothing more ("returned from fn", "idle", ...)}.
    ``previous``: the looks before, for the deadlock rule (blocked the same in both).
    ``settled``: the absent ranks that left long enough before these looks that a running rank
    still waiting cannot be waking from a collective they made their part of (None: all of them).
    Only a wait nothing numbers needs it: rank 0 returns from an all_reduce a moment before rank 1
    wakes from it, and where no recorder counts what rank 0 issued, only that moment's end tells.
    The watch settles at once a rank that left otherwise than :data:`LEFT_DONE` (raised, died,
    idle): the call fails anyway, and at once."""
    running = {r: s for r, s in snaps.items() if r not in absent}
    return (_mismatch(snaps, running) or _bypassed(snaps, running, world)
            or _absent(snaps, running, world, absent, settled)
            or _deadlock(snaps, running, world, absent, previous or {}))


def judge_returned(snaps: dict[int, Snapshot]) -> Optional[Verdict]:
    """The verdict on what every rank issued, once every rank's function returned (``snaps``:
    their RETURNED snapshots): a "wrong value" when two ranks completed the same collective
    number of a group with tensors that cannot be one collective, else None."""
    for r in sorted(snaps):
        for op in snaps[r].ops:
            if not op.done or op.seq is None or op.group is None:
                continue
            for q in sorted(snaps):
                other = snaps[q].op_at(op.group, op.seq) if q > r else None
                why = why_apart(op, other) if other is not None and other.done else None
                if other is None or why is None:
                    continue
                culprit = _got_the_wrong_value(r, op, q, other)
                what = (f"rank {culprit} got a wrong value from {op.kind} #{op.seq} (the ranks passed {why}, "
                        "and every rank returned): "
                        + ops_text([(r, snaps[r], op), (q, snaps[q], other)]))
                return Verdict("wrong value", [], what=what, culprit=culprit)
    return None


def _got_the_wrong_value(r: int, a: Op, q: int, b: Op) -> int:
    """Of two ranks that completed one collective with different tensors, the one whose value is
    wrong: a rooted op's non-root; else the one with the bigger tensors (a transport fills at
    most what the other sent: the rest is what the buffer held before)."""
    root = a.root if a.root is not None else b.root
    if a.kind in ROOTED and root in (r, q):
        return q if root == r else r
    return q if sum(numel(shown_tensors(b))) > sum(numel(shown_tensors(a))) else r


# -- the rules --------------------------------------------------------------------------------

def _mismatch(snaps: dict[int, Snapshot], running: dict[int, Snapshot]) -> Optional[Verdict]:
    for r in sorted(running):
        for op in running[r].pending:
            if op.seq is None or op.group is None or op.called:
                continue  # a call in its check: its peers' that entered gloo passed theirs (or _bypassed's)
            for q in sorted(snaps):
                other = snaps[q].op_at(op.group, op.seq) if q != r else None
                if other is not None and other.called:
                    continue  # it is compared with this one by the check, not by names gloo records
                why = why_apart(op, other) if other is not None else None
                if other is None or why is None:
                    continue
                if other.done:  # it returned from it: with the wrong value
                    what = (f"rank {q} got a wrong value from {op.kind} #{op.seq} (the ranks passed {why}): "
                            + ops_text(sorted([(q, snaps[q], other), (r, running[r], op)], key=lambda i: i[0])))
                    return Verdict("wrong value", [r], what=what, culprit=q)
                group = _everyone_at(snaps, op)
                what = f"the ranks wait in collectives that cannot match ({why}): " + ops_text(group)
                return Verdict("mismatch", sorted({r, q}), what=what)
    return None


def _bypassed(snaps: dict[int, Snapshot], running: dict[int, Snapshot], world: int) -> Optional[Verdict]:
    """A rank waits in its collective check for a peer's call that will never be published: the
    peer entered that collective number in gloo without a torch.distributed call (DDP's bucket
    all_reduce in backward(), a functional collective, FSDP2's, a ProcessGroup method), so it
    waits there for this rank, which waits for it. Exact in one look: the peer's snapshot reads
    its recorder before its published count, and a call it checked is published before it enters."""
    for r in sorted(running):
        s = running[r]
        for group, published, judged, entered in s.checks:
            if published <= judged:
                continue  # not waiting in its check on this group
            mine = s.op_at(group, entered + 1)
            if mine is None or not mine.called:
                continue
            for q in sorted(running):
                theirs = dict((g, rest) for g, *rest in running[q].checks).get(group) if q != r else None
                if theirs is None or q not in mine.members(world):
                    continue
                q_published, _q_judged, q_entered = theirs
                if q_published > judged or q_entered <= entered:
                    continue  # it published the call r waits for, or has not entered that number
                other = running[q].op_at(group, entered + 1)
                if other is not None and (other.done or other.called):
                    continue
                return Verdict("mismatch", [r, q], what=_bypassed_text(r, s, mine, q, running[q], other))
    return None


def _bypassed_text(r: int, s: Snapshot, mine: Op, q: int, t: Snapshot, other: Optional[Op]) -> str:
    """"the ranks wait for each other (rank 1 entered collective #4 without a torch.distributed call
    ...): rank 0 at Cell In[5], line 2: all_reduce #4 of float32[5] (in the check); rank 1 at line 4:
    all_reduce #4 of float32[1024] (in gloo)"."""
    if other is not None:
        theirs = op_text(other)
    else:  # gloo before torch 2.8 records no collectives: which one it is, torch does not say
        theirs = f"{t.label or 'a collective'} #{mine.seq} (which collective, gloo records from torch 2.8)"
    return (f"the ranks wait for each other (rank {q} entered collective #{mine.seq} without a torch.distributed "
            "call, which the collective check cannot see: DDP's backward, a functional collective, FSDP2 or a "
            f"ProcessGroup method): {ops_text([(r, s, mine)])} (in the check); {_at(q, t, s)}{theirs} (in gloo)")


def _at(q: int, t: Snapshot, s: Snapshot) -> str:
    if t.where is None:
        return f"rank {q}: "
    same = s.where is not None and s.where[0] == t.where[0]
    return f"rank {q} at line {t.where[1]}: " if same else f"rank {q} at {_location(t.where)}: "


def _everyone_at(snaps: dict[int, Snapshot], op: Op) -> list[tuple[int, Snapshot, Op]]:
    """Each rank that holds ``op``'s number of its group, with what it holds there."""
    out = []
    for q in sorted(snaps):
        held = snaps[q].op_at(op.group, op.seq) if op.group is not None and op.seq is not None else None
        if held is not None:
            out.append((q, snaps[q], held))
    return out


def _waits(s: Snapshot) -> list[Optional[Op]]:
    """What a running rank waits on: the recorder's unfinished collectives, else its blocking
    call (None: a wait seen only by its frame, such as a DDP forward's)."""
    found: list[Optional[Op]] = [o for o in s.pending if o.seq is not None]
    if not found and s.blocked is not None:
        found = [s.blocked]
    if not found and s.label:
        found = [None]
    return found


def _absent(snaps: dict[int, Snapshot], running: dict[int, Snapshot], world: int,
            absent: dict[int, str], settled: Optional[Collection[int]]) -> Optional[Verdict]:
    stuck: dict[int, Optional[Op]] = {}
    missing: set[int] = set()
    if not absent:
        return None
    for r in sorted(running):
        s = running[r]
        for op in _waits(s):
            members = op.members(world) if op is not None else tuple(range(world))
            gone = [a for a in sorted(absent) if a in members and a != r]
            if op is not None and op.is_p2p:
                if op.root is not None:
                    gone = [a for a in gone if a == op.root]
                elif any(q != r and q in members for q in running):
                    continue  # a rank it may be waiting for still runs
            elif s.any_peer and any(q != r and q in members for q in running):
                continue
            if op is not None and op.seq is not None and op.group is not None:
                gone = [a for a in gone if a not in snaps or snaps[a].issued.get(op.group, 0) < op.seq]
            if op is not None and op.is_p2p and op.nth is not None:
                # It left having made its part: a send on its way to this recv (gloo's send returns
                # once its bytes are out), a recv posted for this send. The transfer is under way.
                gone = [a for a in gone if a not in snaps or not _made_its_part(snaps[a], op, r)]
            elif settled is not None and not _numbered(op):
                gone = [a for a in gone if a in settled]
            if gone:
                stuck[r] = op
                missing.update(gone)
                break
    if not stuck:
        return None
    waiting = sorted(stuck)
    places = [f"rank {r} at {_location(where)}" for r in waiting if (where := running[r].where) is not None]
    labels = sorted({_label(running[r], stuck[r]) for r in waiting})
    label = " / ".join(labels) + (f" ({'; '.join(places)})" if places else "")
    first = waiting[0]
    op = stuck[first]
    why = {absent[a] for a in missing}
    what = ""
    if op is not None and op.seq is not None and why <= {RETURNED}:
        # ranch: "rank 1 returned from fn without joining all_reduce #3, which rank 0 waits in at ..."
        where = running[first].where
        at = f" at {_location(where)}" if where is not None else ""
        what = (f"{_rank_list(sorted(missing))} returned from fn without joining {op.kind} #{op.seq}, which "
                f"{_rank_list(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in{at}")
    return Verdict("absent", waiting, sorted(missing), what=what, label=label)


def _numbered(op: Optional[Op]) -> bool:
    """Does ``op`` carry a count that tells whether a peer that left made its part of it?"""
    return op is not None and ((op.seq is not None and op.group is not None) or (op.is_p2p and op.nth is not None))


def _made_its_part(theirs: Snapshot, op: Op, r: int) -> bool:
    """Did the rank ``op`` waits on (it left the call) make the call that meets rank ``r``'s
    ``op``, its ``nth`` send to (recv from) that rank? By their counts, per peer."""
    assert op.nth is not None
    if op.kind == "recv":
        return theirs.p2p_count("send", r) >= op.nth
    return theirs.p2p_count("recv", r) + theirs.p2p_count("recv", None) >= op.nth


def _label(s: Snapshot, op: Optional[Op]) -> str:
    if op is not None and op.seq is not None:
        return f"dist.{op.kind}"
    label = s.label or (f"dist.{op.kind}" if op is not None else "a collective")
    return label


def _deadlock(snaps: dict[int, Snapshot], running: dict[int, Snapshot], world: int, absent: dict[int, str],
              previous: dict[int, Snapshot]) -> Optional[Verdict]:
    # Blocked: the same op in this look and the one before (a rank that moved on between two
    # looks is not blocked, whatever it waits in now).
    blocked: dict[int, Op] = {}
    for r, s in running.items():
        op = _blocked_on(s)
        before = previous.get(r)
        if op is not None and before is not None and _blocked_on(before) == op:
            blocked[r] = op
    if len(blocked) < 2:
        return None
    free = {r for r in running if r not in blocked}
    may = set(free)
    reasons: set[str] = set()
    changed = True
    while changed:
        changed = False
        for r, op in blocked.items():
            if r not in may and _can_progress(r, op, snaps, blocked, may, world, reasons):
                may.add(r)
                changed = True
    stuck = sorted(r for r in blocked if r not in may)
    if len(stuck) < 2:
        return None  # one rank alone waits for someone who is not blocked (or left: _absent's case)
    ops = [(r, running[r], blocked[r]) for r in stuck]
    kinds = {blocked[r].kind for r in stuck}
    if reasons:
        why = sorted(reasons)[0]
    elif kinds == {"recv"}:
        why = "each waits to receive from the other" if len(stuck) == 2 else "they all wait to receive"
    elif kinds == {"send"}:
        why = "each waits to send to the other" if len(stuck) == 2 else "they all wait to send"
    else:
        why = "each waits for a rank that waits in something else"
    return Verdict("deadlock", stuck, what=f"the ranks wait for each other ({why}): " + ops_text(ops))


def _blocked_on(s: Snapshot) -> Optional[Op]:
    """The op a rank's thread is blocked in; for NCCL, whose calls return at once, its oldest
    unfinished point-to-point op."""
    if s.blocked is not None:
        return s.blocked
    pending = [o for o in s.pending if o.is_p2p]
    return pending[0] if pending else None


def _can_progress(r: int, op: Op, snaps: dict[int, Snapshot], blocked: dict[int, Op], may: set[int],
                  world: int, reasons: set[str]) -> bool:
    members = [m for m in op.members(world) if m != r]
    if not op.is_p2p:
        if op.seq is None or op.group is None:
            return True  # no number to tell what the others owe: not judged
        return all(m in may or (m in snaps and snaps[m].op_at(op.group, op.seq) is not None) for m in members)
    peers = [op.root] if op.root is not None else members
    for p in peers:
        if p in may:
            return True
        theirs = [blocked[p]] if p in blocked else []
        theirs += [o for o in (snaps[p].pending if p in snaps else []) if o.is_p2p and o not in theirs]
        for other in theirs:
            if pairs(op, r, other, p):
                why = p2p_apart(op, other)
                if why is None:
                    return True
                reasons.add(why)
            elif {op.kind, other.kind} == {"send", "recv"} and op.tag is not None and other.tag is not None \
                    and op.tag != other.tag and (op.root in (None, p)) and (other.root in (None, r)):
                reasons.add("a different tag")
    return False


# -- in words -----------------------------------------------------------------------------------

def ops_text(items: list[tuple[int, Snapshot, Op]]) -> str:
    """"rank 0 at Cell In[7], line 2: all_reduce #5 of float32[4]; rank 1 at line 3: broadcast
    #5 of float32[4] from rank 0": each rank's line (a file named once) and op."""
    parts = []
    last_file: Optional[str] = None
    for r, s, op in items:
        at = ""
        if s.where is not None:
            at = f" at line {s.where[1]}" if s.where[0] == last_file else f" at {_location(s.where)}"
            last_file = s.where[0]
        unknown = op.is_p2p and op.root is None and s.any_peer and s.label
        parts.append(f"rank {r}{at}: {s.label if unknown else op_text(op)}{' (returned)' if op.done else ''}")
    return "; ".join(parts)


def where_text(snaps: dict[int, Snapshot], now_ns: int, prompts: frozenset = frozenset(),
               short: bool = False, gone: Optional[dict[int, str]] = None) -> str:
    """Where each rank is: "rank 0 at Cell In[5], line 3: waits in all_reduce #5 of float32[4]
    (12 s); rank 1 at line 7: running" (``short``: "rank 0 in all_reduce #5 (line 3); rank 1
    running line 7", for the live line). ``gone``: ranks with no look, and why."""
    parts = []
    last_file: Optional[str] = None
    for r in sorted(set(snaps) | set(gone or {})):
        if r not in snaps:
            parts.append(f"rank {r} {(gone or {})[r]}")
            continue
        s = snaps[r]
        doing = _doing_text(s, now_ns, r in prompts, short)
        if short:
            line = f" (line {s.where[1]})" if s.where is not None else ""
            parts.append(f"rank {r} running line {s.where[1]}" if doing == "running" and s.where is not None
                         else f"rank {r} {doing}{line}")
            continue
        at = ""
        if s.where is not None:
            at = f" at line {s.where[1]}" if s.where[0] == last_file else f" at {_location(s.where)}"
            last_file = s.where[0]
        parts.append(f"rank {r}{at}: {doing}")
    return "; ".join(parts) + unchecked_note(snaps)


def unchecked_note(snaps: dict[int, Snapshot]) -> str:
    """What :func:`where_text` adds where ranks wait in collectives no recorder numbered (gloo
    before torch 2.8): that whether they match went unchecked, and which torch checks it."""
    unnumbered = [r for r, s in snaps.items()
                  if (op := _waiting_op(s)) is not None and not op.is_p2p and op.seq is None]
    if len(unnumbered) < 2 or compat.gloo_records_collectives():
        return ""
    return (f" (whether these collectives match is not checked: gloo records them from torch 2.8, "
            f"this is torch {compat.installed_torch_version()})")


def _doing_text(s: Snapshot, now_ns: int, at_prompt: bool, short: bool) -> str:
    if at_prompt:
        return "at a prompt"
    op = _waiting_op(s)
    if op is not None:
        waited = waited_s(s, now_ns)
        text = f"in {op_text(op, sizes=not short)}" if short else f"waits in {op_text(op)}"
        return text if short or waited is None else f"{text} ({waited:.0f} s)"
    if s.label:
        return f"in {s.label}" if short else f"waits in {s.label}"
    if s.doing.startswith("in "):
        return s.doing if short else f"blocked {s.doing}"
    return s.doing


def _waiting_op(s: Snapshot) -> Optional[Op]:
    pending = s.pending
    if s.blocked is not None:
        return s.blocked
    return pending[0] if pending and s.doing != "running" else None


def waited_s(s: Snapshot, now_ns: int) -> Optional[float]:
    """How long the rank has waited in its oldest unfinished op (the recorder's time)."""
    times = [o.issued_ns for o in s.pending if o.issued_ns]
    return max(0.0, (now_ns - min(times)) / 1e9) if times else None


def stack_lines(s: Snapshot) -> list[str]:
    """A rank's stack as a traceback shows it (outermost first), its source lines from here
    (a cell's are in this process's linecache)."""
    import linecache

    lines = []
    for filename, lineno, name in s.stack:
        lines.append(f"{source_location(filename)}, line {lineno}, in {name}")
        source = linecache.getline(filename, lineno).strip()
        if source:
            lines.append(f"  {source}")
    return lines


def doing_text(s: Snapshot, now_ns: int, at_prompt: bool = False) -> str:
    """What a rank does, in words: "waits in all_reduce #5 of float32[4] (12 s)", "running"."""
    return _doing_text(s, now_ns, at_prompt, short=False)


def _location(where: tuple[str, int]) -> str:
    return f"{source_location(where[0])}, line {where[1]}"


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
