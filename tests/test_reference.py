"""The reference pages list everything a user can meet: every public name, every magic with its options,
every ``MPIFY_NB_*`` variable the code reads and every error class a user can see (issue 39).

Each check compares a page of docs/reference/ with the code itself (``mpify_nb.__all__``, the magics that
``%load_ext mpify_nb`` registers and their parsers, the variables named in src/, the exception classes
defined in src/), so a name added to the code without its reference fails here, saying which name is
missing from which page and what to add.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import mpify_nb

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "mpify_nb"
REFERENCE = ROOT / "docs" / "reference"
API, MAGICS, ENVIRONMENT, ERRORS = (REFERENCE / f"{name}.md" for name in ("api", "magics", "environment", "errors"))

#: Exception classes under src/ that never reach a user, each with where it is caught.
INTERNAL_ERRORS = {
    "Aborted": "launcher/own_rank.py: thrown into the caller's own rank when another rank failed; the call "
               "catches it and raises that rank's error",
    "TemplateRetired": "start/placement.py: a template being replaced; the call asks the new one",
    "CheckAborted": "torchdist/checks/groups.py: a Session rank waiting in its collective check when the group is "
                    "aborted under it; the Session drops that answer and raises the call's CollectiveError",
    "CollectivesApart": "torchdist/checks/groups.py: the check's refusal where rank/checks.py installed no error of "
                        "its own; every rank and the notebook's own rank install CollectiveError",
    "Unchecked": "torchdist/checks/calls.py: a call whose arguments the check does not judge; wrappers.py catches "
                 "it and lets the call run",
}


def _page(path: Path) -> str:
    return path.read_text()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the ::: directives (mkdocstrings) -----------------------------------------------------------------

_DIRECTIVE = re.compile(r"^:::\s*(?P<path>[\w.]+)\s*$", re.M)


def _resolve(path: str) -> Any:
    """The object a ``::: a.b.C`` directive names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _directives(page: Path) -> dict[str, int]:
    text = _page(page)
    return {m["path"]: text.count("\n", 0, m.start()) + 1 for m in _DIRECTIVE.finditer(text)}


def test_every_reference_directive_names_an_object_that_exists():
    """A module moved (the house branch does) leaves a ``:::`` path behind: say which, and where."""
    broken = []
    for page in sorted(REFERENCE.glob("*.md")):
        for path, line in _directives(page).items():
            try:
                _resolve(path)
            except (ImportError, AttributeError) as e:
                broken.append(f"{_rel(page)}:{line}: `::: {path}` names nothing ({type(e).__name__}: {e}); "
                              "write the object's current path (or its public name, mpify_nb.X)")
    assert not broken, "\n".join(broken)


def _is_exception(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseException)


def test_every_public_name_is_on_its_reference_page():
    missing = []
    for name in mpify_nb.__all__:
        obj = getattr(mpify_nb, name)
        page = ERRORS if _is_exception(obj) else API
        shown = [path for path in _directives(page) if _resolve(path) is obj]
        if not shown:
            missing.append(f"mpify_nb.{name} is in mpify_nb.__all__ but not on {_rel(page)}: add "
                           f"`::: mpify_nb.{name}` there" + (" and a row to its table" if page == ERRORS else
                                                             ", under the section it belongs to"))
    assert not missing, "\n".join(missing)


# -- magics ----------------------------------------------------------------------------------------

_LIST_MAGICS = textwrap.dedent("""
    import ast, inspect, json, re, textwrap
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    before = {kind: dict(table) for kind, table in shell.magics_manager.magics.items()}
    shell.run_line_magic("load_ext", "mpify_nb")
    OPTION = re.compile(r"-[a-z]|--[a-z][a-z0-9-]*")

    def options(fn):
        func = getattr(fn, "__func__", fn)
        found = set()
        parser = getattr(func, "parser", None)  # IPython's @magic_arguments
        if parser is not None:
            for action in parser._actions:
                found.update(s for s in action.option_strings if s not in ("-h", "--help"))
        # options a magic parses by hand: the option-like string constants of its code
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        found.update(node.value for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str) and OPTION.fullmatch(node.value))
        return sorted(found)

    found = {}
    for kind, table in shell.magics_manager.magics.items():
        for name, fn in table.items():
            func = getattr(fn, "__func__", fn)
            if getattr(func, "__module__", "").startswith("mpify_nb") or name not in before.get(kind, {}):
                found[("%%" if kind == "cell" else "%") + name] = options(fn)
    print(json.dumps(found))
""")


def registered_magics() -> dict[str, list[str]]:
    """``{"%%ranch": ["--ddp", ...], "%dist_init": [...]}``: what ``%load_ext mpify_nb`` adds to a fresh
    IPython shell (in a process of its own: loading the extension changes the shell's process)."""
    done = subprocess.run([sys.executable, "-c", _LIST_MAGICS], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**__import__("os").environ, "MPIFY_NB_PREWARM": "0"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def sections(text: str) -> dict[str, str]:
    """Each heading's text -> the page's text from that heading to the next heading of its level or above."""
    heads = [(m.start(), len(m["hashes"]), m["title"]) for m in re.finditer(r"^(?P<hashes>#{1,6}) (?P<title>.*)$",
                                                                          text, re.M)]
    found = {}
    for i, (start, level, title) in enumerate(heads):
        end = next((s for s, lvl, _ in heads[i + 1:] if lvl <= level), len(text))
        found[title.strip()] = text[start:end]
    return found


def _section_of(magic: str, page: dict[str, str]) -> str | None:
    for title, body in page.items():
        if re.search(rf"`{re.escape(magic)}(?![\w])", title):
            return body
    return None


def test_every_magic_and_each_of_its_options_is_on_the_magics_page():
    magics = registered_magics()
    assert {"%%ranch", "%dist_init", "%%rank", "%dist_pull"} <= set(magics), magics  # the listing works
    assert {"--ddp", "--timeout"} <= set(magics["%%ranch"]) and {"--all", "--rank"} <= set(magics["%dist_pull"])
    page = sections(_page(MAGICS))
    problems = []
    for magic, options in sorted(magics.items()):
        body = _section_of(magic, page)
        if body is None:
            problems.append(f"{magic} is registered by %load_ext mpify_nb but has no section on {_rel(MAGICS)}: "
                            f"add a heading '### `{magic}`' with its usage line and what it does")
            continue
        for option in options:
            if not re.search(rf"`{re.escape(option)}(?![\w-])", body):
                problems.append(f"{magic}'s option {option} is not in its section of {_rel(MAGICS)}: add a row "
                                f"'| `{option}` | what it does |' to its table")
    documented = {m for title in page for m in re.findall(r"`(%%?\w+)`", title)}
    problems += [f"{_rel(MAGICS)} has a section for {m}, which %load_ext mpify_nb does not register: remove it "
                 "or register the magic" for m in sorted(documented - set(magics))]
    assert not problems, "\n".join(problems)


# -- environment variables ----------------------------------------------------------------------------

_VARIABLE = re.compile(r"\bMPIFY_NB_[A-Z0-9_]*[A-Z0-9]\b")


def variables_read_by(paths: list[Path]) -> dict[str, str]:
    """Each MPIFY_NB_* name in these files -> the first place it is named."""
    found: dict[str, str] = {}
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in _VARIABLE.findall(line):
                found.setdefault(name, f"{_rel(path)}:{number}")
    return found


def test_every_variable_the_code_reads_is_on_the_environment_page():
    in_code = variables_read_by(sorted(SRC.rglob("*.py")))
    assert {"MPIFY_NB_PRELOAD", "MPIFY_NB_START_METHOD"} <= set(in_code), in_code  # the search works
    page = _page(ENVIRONMENT)
    listed = set(_VARIABLE.findall(page))
    missing = [f"{name} (read at {where}) is not on {_rel(ENVIRONMENT)}: add a row for it (its values, what it "
               "does; under 'Set by mpify_nb' if only mpify_nb sets it)" for name, where in sorted(in_code.items())
               if name not in listed]
    tools = variables_read_by([ROOT / "mkdocs_hooks.py", ROOT / "noxfile.py", *sorted((ROOT / "tests").rglob("*.py"))])
    stale = [f"{_rel(ENVIRONMENT)} lists {name}, which nothing reads (src/, mkdocs_hooks.py, tests/): remove it"
             for name in sorted(listed - set(in_code) - set(tools))]
    assert not missing + stale, "\n".join(missing + stale)


# -- error classes ---------------------------------------------------------------------------------

def exception_classes() -> dict[str, str]:
    """Each exception class defined under src/ -> where (``wire/errors.py:38``), found by reading the
    source: a class whose base is a builtin exception, or another class found here."""
    import builtins

    defined: dict[str, tuple[list[str], str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
                defined[node.name] = (bases, f"{path.relative_to(SRC)}:{node.lineno}")
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    found: dict[str, str] = {}
    grew = True
    while grew:
        grew = False
        for name, (bases, where) in defined.items():
            if name not in found and any(b in builtin or b in found for b in bases):
                found[name] = where
                grew = True
    return found


def test_every_error_class_a_user_can_see_is_on_the_errors_page():
    classes = exception_classes()
    assert {"RankError", "CollectiveError", "SessionClosedError", "Aborted"} <= set(classes), classes
    page = _page(ERRORS)
    rendered = {path.rsplit(".", 1)[-1] for path in _directives(ERRORS)}
    problems = []
    for name, where in sorted(classes.items()):
        if name in INTERNAL_ERRORS:
            continue
        if not re.search(rf"^\| \[?`{name}`", page, re.M):
            problems.append(f"{name} ({where}) can reach a user but has no row in the table of {_rel(ERRORS)}: add "
                            f"'| [`{name}`](#...) | its base | raised when | what to do |' (or, if no user can ever "
                            "see it, add it to INTERNAL_ERRORS in tests/test_reference.py with where it is caught)")
        if name not in rendered:
            problems.append(f"{name} ({where}) has no `:::` entry on {_rel(ERRORS)}: add `::: mpify_nb.<its path>."
                            f"{name}` (its docstring: what it means, with an example)")
    stale = [f"INTERNAL_ERRORS names {name}, which src/ no longer defines" for name in INTERNAL_ERRORS
             if name not in classes]
    assert not problems + stale, "\n".join(problems + stale)
