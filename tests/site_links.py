"""A crawl of the built docs site: every internal link and anchor resolves, the notebook pages included.

``mkdocs build --strict`` checks the links of the Markdown pages, but not those of the example notebooks
(mkdocs-jupyter renders them to HTML after mkdocs' own validation) nor the anchors its table of contents
and headings end up with. This reads what a browser would: every ``.html`` file under the site folder,
every ``href``/``src`` that stays inside the site, and checks that its file exists and that its
``#fragment`` names an ``id`` (or ``<a name>``) in that file.

    python tests/site_links.py site        # nox -s docs runs it after the build; exit 1 lists each broken link

tests/test_site_links.py checks the crawl itself on small sites it writes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: Attributes that name another file of the site: links, images, scripts, stylesheets.
_URL_ATTRIBUTES = {("a", "href"), ("link", "href"), ("img", "src"), ("script", "src"), ("source", "src")}


@dataclass(frozen=True)
class Link:
    page: str      # the page it is on, relative to the site's root
    url: str       # as written in the page
    line: int


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.urls: list[tuple[str, int]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            if (tag, name) in _URL_ATTRIBUTES:
                self.urls.append((value, self.getpos()[0]))


def _internal(url: str) -> bool:
    parts = urlsplit(url)
    return not (parts.scheme or parts.netloc or url.startswith("//"))


def _target(site: Path, page: Path, path: str) -> Path:
    """The file a relative (or site-absolute) path names, as a static server would serve it."""
    base = site if path.startswith("/") else page.parent
    target = (base / unquote(path.lstrip("/"))) if path else page
    if path.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target


class Site:
    """The pages of a built site, each read once."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._pages: dict[Path, _Page] = {}

    def page(self, path: Path) -> _Page:
        path = path.resolve()
        if path not in self._pages:
            parsed = _Page()
            parsed.feed(path.read_text(encoding="utf-8", errors="replace"))
            parsed.close()
            self._pages[path] = parsed
        return self._pages[path]

    def html_files(self) -> list[Path]:
        return sorted(self.root.rglob("*.html"))

    def problems(self) -> tuple[int, list[str]]:
        """(how many internal links were checked, one line per broken one)."""
        checked, broken = 0, []
        for file in self.html_files():
            where = file.relative_to(self.root)
            for url, line in self.page(file).urls:
                if not _internal(url):
                    continue
                checked += 1
                why = self._why_broken(file, url)
                if why:
                    broken.append(f"{where}:{line}: {url!r}: {why}")
        return checked, broken

    def _why_broken(self, page: Path, url: str) -> str:
        parts = urlsplit(url)
        target = _target(self.root, page, parts.path)
        try:
            target.resolve().relative_to(self.root)
        except ValueError:
            return "points outside the site"
        if not target.is_file():
            return f"no such file ({target.relative_to(self.root) if target.is_relative_to(self.root) else target})"
        fragment = unquote(parts.fragment)
        if fragment and target.suffix == ".html" and fragment not in self.page(target).ids:
            shown = "this page" if target.resolve() == page.resolve() else str(target.relative_to(self.root))
            return f"no anchor #{fragment} in {shown}"
        return ""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/site_links.py SITE_DIR", file=sys.stderr)
        return 2
    site = Site(Path(argv[0]))
    pages = site.html_files()
    if not pages:
        print(f"{argv[0]}: no .html files: build the site first (nox -s docs, or mkdocs build)", file=sys.stderr)
        return 1
    checked, broken = site.problems()
    for line in broken:
        print(line, file=sys.stderr)
    print(f"{len(pages)} pages, {checked} internal links and anchors checked, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
