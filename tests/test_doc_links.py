"""Every relative link in README.md, CHANGELOG.md and docs/*.md leads somewhere: the file exists and
a `#fragment` names a heading of it, as GitHub turns headings into anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def prose(text: str) -> list[str]:
    """The lines of `text` outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of `page`'s headings; a repeated heading's get `-1`, `-2`, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(page.read_text()):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(1))
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return found


def links(page: Path) -> list[str]:
    return [target for line in prose(page.read_text()) for target in LINK.findall(line)]


LINKS = [(page, target) for page in PAGES for target in links(page) if not re.match(r"[a-z]+:", target)]


def test_the_pages_link_to_each_other():
    assert len(LINKS) > 30


@pytest.mark.parametrize("page, target", LINKS, ids=[f"{p.name}->{t}" for p, t in LINKS])
def test_link_leads_to_a_file_and_heading(page, target):
    path, _, fragment = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{page.name} links to {path}, which does not exist"
    if fragment:
        assert fragment in anchors(linked), f"{page.name} links to #{fragment}, not a heading of {linked.name}"


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("A request's life", "a-requests-life"),
        ("Metal kernels: cost model", "metal-kernels-cost-model"),
        ("`mlxkv serve` and `/v1/completions`", "mlxkv-serve-and-v1completions"),
        ("Speed on Linux", "speed-on-linux"),
    ],
)
def test_anchors_are_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_a_repeated_heading_gets_a_number(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Notes\n\n## Notes\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"notes", "notes-1"}
