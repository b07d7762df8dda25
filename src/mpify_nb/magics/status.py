"""``%dist_status``'s table: one row per rank, as text and as HTML.

::

    %dist_status
    rank  pid    state  device  RSS       GPU memory  last cell
    0     41021  idle   cpu     310.2 MB  -           x = rank
"""

from __future__ import annotations

import html
import re
from typing import Optional


def format_bytes(n: Optional[int]) -> str:
    """``173.2 MB``; ``-`` for None (a dead rank, no GPU)."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def _short_exit(detail: str) -> str:
    """"rank 1 was killed by SIGKILL (killed by hand, or ...)" -> "killed by SIGKILL"."""
    detail = re.sub(r"^rank \d+ (was |has )?", "", detail.splitlines()[0] if detail else "")
    return re.sub(r"\s*\(.*$", "", detail)[:40]


def status_table(rows: list) -> tuple[str, str]:
    """(text, html) of ``Session.status()`` rows: rank, pid, state, device, RSS, GPU memory, last
    cell; and each rank's node when they are not all on this machine (under Ray)."""
    head = ["rank", "pid", "state", "device", "RSS", "GPU memory", "last cell"]
    elsewhere = any(_node_of(row) != "127.0.0.1" for row in rows)
    if elsewhere:
        head.insert(2, "node")
    cells = []
    for row in rows:
        state = row.state + (f" ({_short_exit(row.exit_detail)})" if getattr(row, "exit_detail", "") else "")
        last = (row.last_cell or "").splitlines()[0] if row.last_cell else ""
        cells.append([str(row.rank), str(row.pid), state, str(row.device), format_bytes(row.rss),
                      format_bytes(row.gpu_memory), last[:60]])
        if elsewhere:
            cells[-1].insert(2, _node_of(row))
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
    text = "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in [head, *cells])
    style = ' style="text-align:left"'
    header = "".join(f"<th{style}>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td{style}>{html.escape(v)}</td>" for v in line) + "</tr>" for line in cells)
    return text, f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


def _node_of(row) -> str:
    return getattr(row, "node", "127.0.0.1")

