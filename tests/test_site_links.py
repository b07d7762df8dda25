"""The docs site's links (issue 39): the crawl of the built site (tests/site_links.py, run by ``nox -s docs``
after the build) finds every broken link and anchor; the notebook pages' tables of contents link to their
own headings (mkdocs_hooks.py); and the answers a newcomer looks for are at most two clicks from Home.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import site_links

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: The pages a newcomer needs first (issue 39): how the pieces fit, and the two commonest troubles.
ANSWERS = ["concepts.md", "howto/hangs.md", "howto/rank-died.md"]
#: The pages that must link to each of them directly.
LINKED_FROM = ["index.md", "guide/debugging.md", "guide/troubleshooting.md"]


# -- the crawl ---------------------------------------------------------------------------------------

def _site(root: Path, pages: dict[str, str]) -> Path:
    for name, body in pages.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<html><body>{body}</body></html>")
    return root


def test_the_crawl_finds_each_broken_link_and_anchor_and_passes_good_ones(tmp_path):
    site = _site(tmp_path, {
        "index.html": '<h2 id="top">Top</h2><a href="#top">ok</a> <a href="guide/">ok</a> '
                      '<a href="guide/#moving-data-dist_push">ok</a> <a href="guide/#moving-data">broken anchor</a> '
                      '<a href="missing/">broken page</a> <a href="https://example.org/x#y">external</a> '
                      '<img src="images/pic.png"> <a href="#nowhere">broken here</a> <a href="mailto:a@b">mail</a>',
        "guide/index.html": '<h2 id="moving-data-dist_push">Moving data: <code>%dist_push</code></h2>'
                            '<a href="../#top">ok</a> <a href="../../outside.html">outside</a> <a name="old">x</a>'
                            '<a href="#old">ok</a>',
    })
    (site / "images").mkdir()
    (site / "images" / "pic.png").write_bytes(b"")
    checked, broken = site_links.Site(site).problems()
    assert checked == 10  # the external link and the mail address are not the site's
    assert broken == [
        "guide/index.html:1: '../../outside.html': points outside the site",
        "index.html:1: 'guide/#moving-data': no anchor #moving-data in guide/index.html",
        "index.html:1: 'missing/': no such file (missing/index.html)",
        "index.html:1: '#nowhere': no anchor #nowhere in this page",
    ]


def test_the_crawl_fails_its_command_when_a_link_is_broken_and_says_so(tmp_path, capsys):
    site = _site(tmp_path / "site", {"index.html": '<a href="#gone">x</a>'})
    assert site_links.main([str(site)]) == 1
    out = capsys.readouterr()
    assert "index.html:1: '#gone': no anchor #gone in this page" in out.err
    assert "1 pages, 1 internal links and anchors checked, 1 broken" in out.out
    assert site_links.main([str(tmp_path / "nothing")]) == 1  # no site built: a failure, not a pass


# -- the notebook pages' tables of contents ------------------------------------------------------------

def test_a_notebook_pages_contents_keep_inline_code_and_link_to_its_own_headings():
    """mkdocs-jupyter made "Moving data: , ," linking to #moving-data from a heading whose id is
    #moving-data-dist_push-dist_pull-to-both; the hook rebuilds the contents from the page's headings."""
    pytest.importorskip("mkdocs")
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "mkdocs_hooks.py")
    assert spec and spec.loader
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = ('<h1 id="persistent-ranks">Persistent ranks<a class="anchor-link" href="#persistent-ranks">¶</a></h1>'
            '<h2 id="moving-data-dist_push-dist_pull">Moving data: <code>%dist_push</code>, <code>%dist_pull</code>'
            '<a class="anchor-link" href="#moving-data-dist_push-dist_pull">¶</a></h2><p>text</p>'
            '<h3 id="a-b">A &lt;b&gt;</h3><h2 id="next">Next</h2><h2>no id</h2>')
    tokens = hooks.toc_tokens(page)
    assert [(t["level"], t["id"], t["name"]) for t in tokens] == [(1, "persistent-ranks", "Persistent ranks")]
    children = tokens[0]["children"]
    assert [(t["id"], t["name"]) for t in children] == [
        ("moving-data-dist_push-dist_pull", "Moving data: %dist_push, %dist_pull"), ("next", "Next")]
    assert [(t["id"], t["name"]) for t in children[0]["children"]] == [("a-b", "A &lt;b&gt;")]
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", hooks.package_version())
    assert hooks.on_page_markdown("docs of {{ version }}", None, None, None) == f"docs of {hooks.package_version()}"


# -- two clicks from Home ----------------------------------------------------------------------------

_LINK = re.compile(r"\]\((?P<url>[^)\s]+)\)")
_HEADING = re.compile(r"^(#{2,3}) (.+)$", re.M)


def _slug(title: str) -> str:
    """Python-Markdown's toc slug of a heading (the ids the site's pages get)."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", title)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def page_sections(page: str) -> list[str]:
    """The ``##``/``###`` anchors of a page of docs/ (its table of contents: one click each)."""
    return [_slug(m.group(2)) for m in _HEADING.finditer((DOCS / page).read_text())]


def page_links(page: str) -> set[tuple[str, str]]:
    """(page, anchor) of each link in a page of docs/ to another (or the same) page of docs/."""
    found = set()
    for m in _LINK.finditer((DOCS / page).read_text()):
        parts = urlsplit(m["url"])
        if parts.scheme or parts.netloc or not (parts.path.endswith(".md") or not parts.path):
            continue
        target = (DOCS / page).parent / parts.path if parts.path else DOCS / page
        found.add((str(target.resolve().relative_to(DOCS.resolve())), parts.fragment))
    return found


def clicks_from_home(limit: int = 2) -> dict[tuple[str, str], int]:
    """The fewest clicks from Home's content to each (page, section) of docs/, following the pages' own links
    and their tables of contents (not the site's navigation, hidden on a phone)."""
    seen = {("index.md", ""): 0}
    frontier = ["index.md"]
    for depth in range(1, limit + 1):
        reached = []
        for page in frontier:
            here = page_links(page) | {(page, section) for section in page_sections(page)}
            for target in here:
                if target not in seen:
                    seen[target] = depth
                    if target[0] not in frontier and (DOCS / target[0]).exists():
                        reached.append(target[0])
        frontier = sorted(set(reached))
    return seen


def test_each_answer_and_each_of_its_sections_is_two_clicks_from_home():
    seen = clicks_from_home()
    reached_pages: dict[str, int] = {}
    for (page, _), n in seen.items():
        reached_pages[page] = min(n, reached_pages.get(page, n))
    problems = []
    for page in ANSWERS:
        if not (DOCS / page).exists():
            problems.append(f"docs/{page} does not exist")
            continue
        if reached_pages.get(page, 9) > 1:
            problems.append(f"docs/{page} is not linked from Home's content (docs/index.md)")
        for section in page_sections(page):
            clicks = min((n for (p, a), n in seen.items() if p == page and a == section), default=None)
            if clicks is None:
                problems.append(f"docs/{page}#{section} is more than 2 clicks from Home")
    assert not problems, "\n".join(problems)


def test_the_answers_are_linked_from_home_debugging_and_troubleshooting():
    missing = [f"docs/{source} has no link to {answer}" for source in LINKED_FROM for answer in ANSWERS
               if answer not in {page for page, _ in page_links(source)}]
    assert not missing, "\n".join(missing)


def test_the_click_count_is_real():
    """A page linked only from a page two clicks away is three clicks away: not counted."""
    seen = clicks_from_home(limit=1)
    assert seen[("howto/hangs.md", "")] == 1
    assert not any(page == "howto/hangs.md" and anchor == "3-find-your-case" and n > 1 for (page, anchor), n in
                   clicks_from_home().items())
    assert ("architecture.md", "the-engine") not in seen  # a section of a page Home links: two clicks


def test_every_page_of_docs_is_in_the_navigation():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "python"))

    def pages(items):
        for item in items:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            if isinstance(value, list):
                yield from pages(value)
            else:
                yield value

    in_nav = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    notebooks = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.ipynb")}
    assert on_disk - in_nav == set(), "pages of docs/ missing from mkdocs.yml's nav"
    assert notebooks - in_nav == set(), "example notebooks missing from mkdocs.yml's nav"
    assert "changelog.md" in in_nav and "--8<-- \"CHANGELOG.md\"" in (DOCS / "changelog.md").read_text()
