"""What one call tells the next (issue 36): its ranks' news, passed on as they arrive, so the next
call's ranks are born warm::

    rank ── IMPORTED (as it goes) ──> template.learn(): the template imports them too, beside the call
    rank ── GPU_USED (at its end) ──> after the call: spares.pool.after_call({rank: GPU}), a spare
                                      rank made ready on that GPU for the next call (start/spares.py)
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

from ..engine import core
from ..start import placement, spares, template
from ..wire.protocol import GPU_USED, IMPORTED


class ForNextCall:
    """Hears a call's ranks say what they imported and which GPU they used, for the next call."""

    def __init__(self, engine: core.Engine) -> None:
        self.gpus_used: dict[int, int] = {}  # rank -> the CUDA device it used
        engine.on(IMPORTED, self._on_imported)
        engine.on(GPU_USED, self._on_gpu_used)

    def _on_imported(self, handle: Any, req: int, body: Any, fds: list) -> None:
        if placement.get_start_method() != "template":
            return
        try:
            template.learn(pickle.loads(body))
        except Exception:
            pass  # only a speed-up is lost

    def _on_gpu_used(self, handle: Any, req: int, body: Any, fds: list) -> None:
        try:
            self.gpus_used[handle.rank] = int(pickle.loads(body))
        except Exception:
            pass

    def call_ended(self, placer: placement.Placer, ranks: dict[int, Any]) -> None:
        """The call is over: spare ranks for its ranks (those the caller did not play)."""
        if ranks and isinstance(placer, placement.TemplatePlacer):
            used: dict[int, Optional[int]] = {r: self.gpus_used.get(r) for r in ranks}
            spares.pool.after_call(used)
