"""How pytest-xdist's workers share the suite (tests/README.md: CI's time budget).

xdist's ``--dist loadfile`` gives each worker whole modules, in the order of their test count. Two
things made the run end with one worker busy and the others idle: the longest module
(test_docs.py, a kernel per page) was one unit, and a long module that came late in the queue ran
alone at the end. Here:

* a module in :data:`SPLIT_BY_TEST` (its tests share no fixture: each starts its own kernel) is cut
  into one unit per test, which either worker may take;
* the queue starts with the longest units (:data:`SECONDS`, measured), so what is left at the end is
  short. Units not listed keep xdist's order after them.

Every other module stays one unit on one worker: its module fixtures (a kernel, a Ray cluster, a
template) are made once and its tests keep their order.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

#: Modules whose tests are independent units.
SPLIT_BY_TEST = {"tests/test_docs.py"}

_PAGE = "tests/test_docs.py::test_page_blocks_run_and_show_what_the_page_says"

#: Wall seconds of the longest units in one CI run (`CI=true bash .ci/run`, both workers busy, load 10-25,
#: November 2026; per test: the worker logs or `--durations=0`, summed per unit). Only their order matters:
#: list a unit here when it grows past ~40 s.
SECONDS = {
    "tests/test_ray.py": 740,  # a 3-node cluster, its own for the token test, Ray Client: mostly waiting
    "tests/test_scripts_notebook.py": 210,
    "tests/test_libraries.py": 200,
    "tests/test_collective_checks.py": 190,
    "tests/test_spares.py": 150,
    "tests/test_failures.py": 150,
    "tests/test_magics.py": 140,
    "tests/test_debugger.py": 135,
    "tests/test_notebook.py": 135,
    "tests/test_mismatch.py": 135,
    "tests/test_relay.py": 110,
    "tests/test_scripts.py": 105,
    "tests/test_fastai.py": 100,
    "tests/test_session_magics.py": 95,
    "tests/test_template.py": 95,
    f"{_PAGE}[docs/guide/libraries.md]": 85,
    "tests/test_preload.py": 80,
    "tests/test_corpus.py": 75,
    "tests/test_session.py": 70,
    "tests/test_warmup.py": 65,
    "tests/test_background_kernel.py": 60,
    "tests/test_torch_versions.py": 55,
    "tests/test_docs.py::test_docstring_examples_run_and_show_what_they_say": 55,
    "tests/test_cleanup.py": 50,
    "tests/test_payload.py": 50,
    f"{_PAGE}[README.md]": 45,
    "tests/test_examples.py": 45,
    "tests/test_ranch.py": 45,
    "tests/test_debugger_replies.py": 40,
    f"{_PAGE}[docs/guide/bring-your-script.md]": 40,
}


class LongestFirst(LoadFileScheduling):
    """``--dist loadfile``, with the modules of :data:`SPLIT_BY_TEST` cut per test and the longest
    units first."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return nodeid if module in SPLIT_BY_TEST else module

    def _assign_work_unit(self, node) -> None:
        """xdist gives a worker the unit at the queue's front: put the longest listed one there first
        (unlisted units weigh 0, so among them xdist's order holds)."""
        longest = max(self.workqueue, key=lambda unit: SECONDS.get(unit, 0))
        self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)
