"""The collective check's cases (issue 35): every mistake a user can make with a collective or a
send/recv on 2 gloo ranks, what it did before the check (``today``: measured with the check off,
which is the code before it), and what it gives now. Ranks import this module by name.

Each case is a cell's source (``rank``, ``torch`` and ``dist`` are defined, as in a persistent
cell); under ``ranch`` it runs through :func:`run_case` as the file ``<case>``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

#: What a mistake did before the check (with it off):
ABORTS = "aborts: gloo kills a rank (SIGABRT), the notebook itself under ranch"
WRONG = "a wrong value, told by the collective watch (ranch: once every rank returned)"
HANGS = "waits until the collective watch ends it"
SILENT = "a wrong value, and nothing says so"
#: How docs/guide/troubleshooting.md's table says each (its rows are this module's CASES).
IN_THE_DOCS = {ABORTS: "**gloo aborts a rank** (SIGABRT; under `ranch`, the notebook)",
               WRONG: "a wrong value, told by the watch", HANGS: "waits until the watch ends it",
               SILENT: "a wrong value, **nothing said**"}


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    today: str
    why: str
    ops: tuple[str, str]  # each rank's call, as the error names it (ranch: the first call on the group)
    lines: tuple[int, int]  # each rank's line of the source
    p2p: bool = False
    session_today: Optional[str] = None  # where a Session differed before: silent where ranch told it
    or_ops: Optional[tuple[str, str]] = None  # the other pair a batch may be judged by first

    def texts(self, at: str = "<case>") -> list[str]:
        """What the error says (before what became of the ranks): one text, or two for a batch."""
        head = "a send and its recv cannot match" if self.p2p else "the ranks called collectives that cannot match"
        return [f"{head} ({self.why}): rank 0 at File \"{at}\", line {self.lines[0]}: {ops[0]}; "
                f"rank 1 at line {self.lines[1]}: {ops[1]}" for ops in (self.ops, self.or_ops) if ops]


def _dtype(a: str, b: str) -> str:
    return f"torch.{a} if rank == 0 else torch.{b}"


CASES = [
    Case("all_reduce dtypes", f"x = torch.ones(4, dtype={_dtype('float32', 'float64')})\ndist.all_reduce(x)",
         ABORTS, "different dtypes", ("all_reduce #1 of float32[4]", "all_reduce #1 of float64[4]"), (2, 2)),
    Case("all_reduce sizes", "x = torch.ones(2 + rank)\ndist.all_reduce(x)", WRONG, "different sizes",
         ("all_reduce #1 of float32[2]", "all_reduce #1 of float32[3]"), (2, 2)),
    Case("all_reduce reduce ops", "x = torch.ones(4)\nop = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX\n"
         "dist.all_reduce(x, op=op)", SILENT, "a different reduce op: SUM, MAX",
         ("all_reduce #1 of float32[4]", "all_reduce #1 of float32[4]"), (3, 3)),
    Case("all_reduce vs broadcast", "x = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(x)\nelse:\n"
         "    dist.broadcast(x, 0)", HANGS, "a different op",
         ("all_reduce #1 of float32[4]", "broadcast #1 of float32[4] from rank 0"), (3, 5)),
    Case("all_reduce vs barrier", "x = torch.ones(4)\ndist.all_reduce(x) if rank == 0 else dist.barrier()",
         HANGS, "a different op", ("all_reduce #1 of float32[4]", "barrier #1"), (2, 2)),
    Case("reduce sizes", "x = torch.ones(2 + rank)\ndist.reduce(x, 0)", WRONG, "different sizes",
         ("reduce #1 of float32[2] to rank 0", "reduce #1 of float32[3] to rank 0"), (2, 2)),
    Case("reduce sizes, dst 1", "x = torch.ones(2 + rank)\ndist.reduce(x, 1)", ABORTS, "different sizes",
         ("reduce #1 of float32[2] to rank 1", "reduce #1 of float32[3] to rank 1"), (2, 2)),
    Case("reduce dst", "x = torch.ones(5)\ndist.reduce(x, 1 - rank)", HANGS, "a different dst",
         ("reduce #1 of float32[5] to rank 1", "reduce #1 of float32[5] to rank 0"), (2, 2)),
    Case("broadcast into a bigger tensor", "y = torch.arange(4.0) if rank == 0 else torch.zeros(5)\n"
         "dist.broadcast(y, 0)", WRONG, "different sizes",
         ("broadcast #1 of float32[4] from rank 0", "broadcast #1 of float32[5] from rank 0"), (2, 2),
         session_today=SILENT),
    Case("broadcast into a smaller tensor", "y = torch.arange(4.0) if rank == 0 else torch.zeros(3)\n"
         "dist.broadcast(y, 0)", ABORTS, "different sizes",
         ("broadcast #1 of float32[4] from rank 0", "broadcast #1 of float32[3] from rank 0"), (2, 2)),
    Case("broadcast dtypes", f"y = torch.ones(4, dtype={_dtype('float32', 'float64')})\ndist.broadcast(y, 0)",
         WRONG, "different dtypes",
         ("broadcast #1 of float32[4] from rank 0", "broadcast #1 of float64[4] from rank 0"), (2, 2),
         session_today=SILENT),
    Case("broadcast src", "x = torch.ones(2, 3)\ndist.broadcast(x, rank)", HANGS, "a different src",
         ("broadcast #1 of float32[2, 3] from rank 0", "broadcast #1 of float32[2, 3] from rank 1"), (2, 2)),
    Case("all_gather sizes", "x = torch.ones(2 + rank)\ndist.all_gather([torch.ones(2 + rank) for _ in range(2)], x)",
         ABORTS, "different sizes", ("all_gather #1 of float32[2]", "all_gather #1 of float32[3]"), (2, 2)),
    Case("all_gather_into_tensor sizes", "x = torch.ones(2 + rank)\n"
         "dist.all_gather_into_tensor(torch.ones(2 * (2 + rank)), x)", ABORTS, "different sizes",
         ("all_gather_into_tensor #1 of float32[2]", "all_gather_into_tensor #1 of float32[3]"), (2, 2)),
    Case("gather sizes", "x = torch.ones(2 + rank)\ndist.gather(x, [torch.ones(2), torch.ones(2)] if rank == 0 "
         "else None, dst=0)", ABORTS, "different sizes",
         ("gather #1 of float32[2] to rank 0", "gather #1 of float32[3] to rank 0"), (2, 2)),
    Case("scatter sizes", "x = torch.ones(2 + rank)\ndist.scatter(x, [torch.ones(2), torch.ones(2)] if rank == 0 "
         "else None, src=0)", WRONG, "different sizes",
         ("scatter #1 of float32[2] from rank 0", "scatter #1 of float32[3] from rank 0"), (2, 2),
         session_today=SILENT),
    Case("reduce_scatter sizes", "out = torch.zeros(2 + rank)\n"
         "dist.reduce_scatter(out, [torch.ones(2 + rank), torch.ones(2 + rank)])", WRONG, "different sizes",
         ("reduce_scatter #1 of float32[2]", "reduce_scatter #1 of float32[3]"), (2, 2)),
    Case("reduce_scatter_tensor sizes", "out = torch.zeros(2 + rank)\n"
         "dist.reduce_scatter_tensor(out, torch.ones(2 * (2 + rank)))", ABORTS, "different sizes",
         ("reduce_scatter_tensor #1 of float32[2]", "reduce_scatter_tensor #1 of float32[3]"), (2, 2)),
    Case("all_to_all sizes", "n = 2 + rank\ndist.all_to_all([torch.zeros(n), torch.zeros(n)], "
         "[torch.ones(n), torch.ones(n)])", ABORTS, "different sizes",
         ("all_to_all #1 of float32[2], float32[2]", "all_to_all #1 of float32[3], float32[3]"), (2, 2)),
    Case("all_to_all_single sizes", "n = 4 + 2 * rank\ndist.all_to_all_single(torch.zeros(n), torch.ones(n))",
         ABORTS, "different sizes", ("all_to_all_single #1 of float32[4]", "all_to_all_single #1 of float32[6]"),
         (2, 2)),
    Case("all_to_all_single splits", "ins, outs = ([1, 2], [3, 1])[rank], ([1, 2], [2, 1])[rank]\n"
         "dist.all_to_all_single(torch.zeros(sum(outs)), torch.ones(sum(ins)), outs, ins)", ABORTS,
         "different sizes", ("all_to_all_single #1 of float32[3]", "all_to_all_single #1 of float32[4]"), (2, 2)),
    Case("on a subgroup", "g = dist.new_group([0, 1])\n"
         f"x = torch.ones(4, dtype={_dtype('float32', 'float64')})\ndist.all_reduce(x, group=g)", ABORTS,
         "different dtypes",
         ("all_reduce #1 on group [0, 1] of float32[4]", "all_reduce #1 on group [0, 1] of float64[4]"), (3, 3)),
    Case("async_op=True", f"x = torch.ones(4, dtype={_dtype('float32', 'float64')})\n"
         "dist.all_reduce(x, async_op=True).wait()", ABORTS, "different dtypes",
         ("all_reduce #1 of float32[4]", "all_reduce #1 of float64[4]"), (2, 2)),
    Case("send into a smaller recv", "if rank == 0:\n    dist.send(torch.ones(4), 1)\nelse:\n"
         "    dist.recv(torch.zeros(3), 0)", ABORTS, "different sizes",
         ("send to rank 1 of float32[4]", "recv from rank 0 of float32[3]"), (2, 4), p2p=True),
    Case("send into a bigger recv", "if rank == 0:\n    dist.send(torch.ones(4), 1)\nelse:\n"
         "    dist.recv(torch.zeros(5), 0)", SILENT, "different sizes",
         ("send to rank 1 of float32[4]", "recv from rank 0 of float32[5]"), (2, 4), p2p=True),
    Case("send and recv dtypes", "if rank == 0:\n    dist.send(torch.ones(4), 1)\nelse:\n"
         "    dist.recv(torch.zeros(4, dtype=torch.float64), 0)", SILENT, "different dtypes",
         ("send to rank 1 of float32[4]", "recv from rank 0 of float64[4]"), (2, 4), p2p=True),
    Case("isend into a smaller irecv", "w = dist.isend(torch.ones(4), 1) if rank == 0 else "
         "dist.irecv(torch.zeros(3), 0)\nw.wait()", ABORTS, "different sizes",
         ("send to rank 1 of float32[4]", "recv from rank 0 of float32[3]"), (1, 1), p2p=True),
    Case("batch_isend_irecv sizes", "peer = 1 - rank\nops = [dist.P2POp(dist.isend, torch.ones(2 + rank), peer),\n"
         "       dist.P2POp(dist.irecv, torch.zeros(2 + rank), peer)]\n"
         "for w in dist.batch_isend_irecv(ops):\n    w.wait()", ABORTS, "different sizes",
         ("send to rank 1 of float32[2]", "recv from rank 0 of float32[3]"), (4, 4), p2p=True,
         or_ops=("recv from rank 1 of float32[2]", "send to rank 0 of float32[3]")),
]


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def run_case(source: str, catch: bool = False):
    """Run a case's source on this rank, as the file ``<case>``. ``catch``: the CollectiveError is
    caught here, and the next all_reduce on the group runs in the same call."""
    import linecache

    import torch
    import torch.distributed as dist
    from mpify_nb.errors import CollectiveError

    rank = dist.get_rank()
    linecache.cache["<case>"] = (len(source), None, source.splitlines(True), "<case>")
    code = compile(source, "<case>", "exec")
    scope = {"torch": torch, "dist": dist, "rank": rank}
    if not catch:
        exec(code, scope)
        return "no error"
    try:
        exec(code, scope)
        caught = "no error"
    except CollectiveError as e:
        caught = str(e)
    x = torch.ones(2) * (rank + 1)
    dist.all_reduce(x)
    return caught, x.tolist()


def working_collective():
    import torch
    import torch.distributed as dist

    x = torch.ones(2) * (int(os.environ["RANK"]) + 1)
    dist.all_reduce(x)
    return x.tolist()


def healthy(workload: str):
    """Calls that match, in the forms the rules must let pass (different shapes of the same
    elements, uneven splits that fit, a root's list, tags out of order, a recv from any rank)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if workload == "shapes":
        x = torch.ones(2, 3) if rank == 0 else torch.ones(6)
        dist.all_reduce(x)
        return x.sum().item()
    if workload == "uneven all_to_all_single":
        out = torch.zeros(3)
        dist.all_to_all_single(out, torch.arange(3.0) + 10 * rank, [1, 2] if rank == 0 else [2, 1],
                               [1, 2] if rank == 0 else [2, 1])
        return out.tolist()
    if workload == "gather and scatter":
        x = torch.ones(2) * rank
        dist.gather(x, [torch.zeros(2), torch.zeros(2)] if rank == 0 else None, dst=0)
        y = torch.zeros(3)
        dist.scatter(y, [torch.ones(3), torch.ones(3) * 2] if rank == 1 else None, src=1)
        return y.tolist()
    if workload == "objects":
        got = [None, None]
        dist.all_gather_object(got, {"rank": rank, "pad": "x" * (100 * rank)})
        objs = [rank * 7] if rank == 1 else [None]
        dist.broadcast_object_list(objs, src=1)
        return [g["rank"] for g in got], objs[0]
    if workload == "tags out of order":
        a, b = torch.ones(2), torch.ones(5)
        if rank == 0:
            works = [dist.isend(a, 1, tag=1), dist.isend(b, 1, tag=2)]
        else:
            a, b = torch.zeros(2), torch.zeros(5)
            works = [dist.irecv(b, 0, tag=2), dist.irecv(a, 0, tag=1)]
        for w in works:
            w.wait()
        return a.sum().item(), b.sum().item()
    if workload == "recv from any rank":
        if rank == 0:
            dist.send(torch.ones(3), 1)
            dist.send(torch.ones(5), 1)
            return None
        first, second = torch.zeros(3), torch.zeros(5)
        dist.recv(first)  # from any rank: the pairings after it are gloo's alone
        dist.recv(second, 0)
        return first.sum().item(), second.sum().item()
    if workload == "ring":
        send, recv = torch.ones(3) * rank, torch.zeros(3)
        w = [dist.isend(send, 1 - rank), dist.irecv(recv, 1 - rank)]
        for work in w:
            work.wait()
        return recv.tolist()
    if workload == "many isends ahead":
        # rank 0 posts 40 isends before rank 1 posts any irecv: more than a ring of slots ahead
        if rank == 0:
            works = [dist.isend(torch.ones(1) * i, 1) for i in range(40)]
        else:
            import time

            time.sleep(0.3)
            bufs = [torch.zeros(1) for _ in range(40)]
            works = [dist.irecv(b, 0) for b in bufs]
        for w in works:
            w.wait()
        return None if rank == 0 else sum(b.item() for b in bufs)
    raise ValueError(workload)


def line_of(text: str) -> int:
    """The number of the line of this file that contains ``text``."""
    from pathlib import Path

    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


def through_the_store():
    """Ranks that share no host (as under Ray across nodes): a group's check goes through its store."""
    import torch
    import torch.distributed as dist
    from mpify_nb.errors import CollectiveError

    from mpify_nb.torchdist.checks import groups, table

    rank = dist.get_rank()
    table._host[:] = [f"another host, {rank}"]  # what host_identity() says on two machines
    group = dist.new_group([0, 1])
    kind = type(groups.known(group)[1].table).__name__
    x = torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)
    try:
        dist.all_reduce(x, group=group)  # through_the_store mismatch
        caught = "no error"
    except CollectiveError as e:
        caught = str(e)
    y = torch.ones(2) * (rank + 1)
    for _ in range(3):  # the store's keys of two collectives back are deleted as the ranks go on
        dist.all_reduce(y, group=group)
    return kind, caught, y.tolist()
