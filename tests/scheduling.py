"""How pytest-xdist's workers share the suite (tests/README.md: CI's time budget).

xdist's ``--dist loadfile`` gives each worker whole modules, in the order of their test count. Three
things made the run slower than its CPU time needs on 2 cores: the longest module (test_docs.py, a
kernel per page) was one unit; a long module that came late in the queue ran alone at the end; and
the modules that keep a core busy (Ray's cluster, the training libraries, kernels starting) ran
beside each other early on (both cores saturated, each slower), while later two waiting modules
(a rank that sleeps, a timeout) left a core idle. The suite is CPU-bound in CI (1,083 CPU-s of
tests beside ~550 CPU-s of installs and nox sessions, on 2 cores). Here:

* a module in :data:`SPLIT_BY_TEST` (its tests share no fixture: each starts its own kernel) is cut
  into one unit per test, which either worker may take;
* a worker is given the longest unit left (:data:`UNITS`, measured), with a unit of the other kind
  than the one the other worker runs counted twice as long: a busy unit beside a waiting one, so
  both cores stay in use and what is left at the end is short. Units not listed come after them,
  in xdist's order.

Every other module stays one unit on one worker: its module fixtures (a kernel, a Ray cluster, a
template) are made once and its tests keep their order.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

#: Modules whose tests are independent units.
SPLIT_BY_TEST = {"tests/test_docs.py"}

_PAGE = "tests/test_docs.py::test_page_blocks_run_and_show_what_the_page_says"

#: (wall seconds, CPU seconds) of the longest units: each xdist worker in a cpuacct cgroup of its own
#: (what the unit's kernels, ranks and Ray processes used included), 2 workers, November 2026. Only
#: their order and their kind matter: list a unit here once it passes ~10 s.
UNITS = {
    "tests/test_ray.py": (218, 202),  # a 3-node cluster, its own for the token test, Ray Client
    "tests/test_libraries.py": (96, 80),
    "tests/test_mismatch.py": (72, 26),
    "tests/test_scripts_notebook.py": (66, 58),
    "tests/test_collective_checks.py": (63, 40),
    "tests/test_relay.py": (58, 53),
    "tests/test_fastai.py": (58, 40),
    "tests/test_notebook.py": (57, 36),
    "tests/test_failures.py": (55, 36),
    "tests/test_scripts.py": (54, 25),
    "tests/test_debugger.py": (47, 24),
    "tests/test_spares.py": (38, 48),
    "tests/test_template.py": (38, 15),
    f"{_PAGE}[docs/guide/libraries.md]": (30, 28),
    "tests/test_magics.py": (29, 23),
    "tests/test_debugger_replies.py": (28, 11),
    "tests/test_corpus.py": (27, 26),
    "tests/test_session_magics.py": (25, 16),
    "tests/test_warmup.py": (23, 18),
    "tests/test_session.py": (22, 13),
    "tests/test_cleanup.py": (22, 5),
    "tests/test_preload.py": (21, 21),
    "tests/test_background_kernel.py": (19, 14),
    "tests/test_torch_versions.py": (17, 16),
    "tests/test_debugger_browser.py": (16, 16),
    "tests/test_stopping.py": (16, 10),
    f"{_PAGE}[docs/guide/background.md]": (15, 6),
    "tests/test_docs.py::test_docstring_examples_run_and_show_what_they_say": (13, 11),
    "tests/test_examples.py": (12, 14),
    "tests/test_payload.py": (11, 15),
    f"{_PAGE}[docs/guide/bring-your-script.md]": (11, 11),
    "tests/test_views.py": (11, 4),
    "tests/test_debugging.py": (10, 3),
}

#: CPU-s per wall-s from which a unit keeps a core busy (below it, it mostly waits).
BUSY = 0.75


def _busy(unit: str) -> bool:
    wall, cpu = UNITS.get(unit, (0, 0))
    return wall > 0 and cpu >= BUSY * wall


class LongestFirst(LoadFileScheduling):
    """``--dist loadfile``, with the modules of :data:`SPLIT_BY_TEST` cut per test and the longest
    units first, a busy one beside a waiting one."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return nodeid if module in SPLIT_BY_TEST else module

    def _running(self, node) -> list[str]:
        """The unit each other worker runs now (the first of its units with a test left)."""
        running = []
        for other, units in self.assigned_work.items():
            if other is not node:
                running += [next((unit for unit, tests in units.items() if not all(tests.values())), "")]
        return running

    def _assign_work_unit(self, node) -> None:
        """xdist gives a worker the unit at the queue's front: put there the longest listed one, a unit
        of the other kind than the other workers run counted twice as long (unlisted units weigh 0,
        so among them xdist's order holds)."""
        busy_beside = sum(_busy(unit) for unit in self._running(node)) > 0

        def weight(unit: str) -> float:
            wall = UNITS.get(unit, (0, 0))[0]
            return wall * (2 if _busy(unit) != busy_beside else 1)

        chosen = max(self.workqueue, key=weight)
        self.workqueue.move_to_end(chosen, last=False)
        super()._assign_work_unit(node)
