"""Every relative link of README.md and docs/*.md resolves: the file exists, and a `#anchor` names a heading of it
(GitHub's slug: lower case, punctuation but `-` and `_` dropped, spaces to `-`, a repeated heading `-1`, `-2`...).
Links and headings inside ``` blocks are not links or headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.torchrun import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(path: Path) -> list[str]:
    """The lines of `path` outside ``` blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in _prose(path):
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def _links(path: Path) -> list[str]:
    return [target for line in _prose(path) for target in LINK.findall(re.sub(r"`[^`]*`", "", line))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_check_sees_the_links_it_checks() -> None:
    """The README's links to the docs it maps (its table), and an anchor of each kind, are found and resolve."""
    links = _links(REPO / "README.md")
    assert "docs/GPU_RESULTS.md#what-has-never-run-on-a-gpu" in links
    assert "docs/ARCHITECTURE.md#what-it-is-and-why-this-one" in links
    assert {f"docs/{p.name}" for p in PAGES[1:]} - {"docs/MUTATIONS.md"} <= set(links)
    assert "sglang-servers-beyond-loopback-the-api-key" in _anchors(REPO / "docs/FAULT_TOLERANCE.md")
