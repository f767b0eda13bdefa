# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every relative link of the README and docs/ names a file of this checkout (and a heading of it,
with an #anchor), and every docs/ path a comment of the example files cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "roles").glob("*/README.md")])
# [text](target) outside code spans; images too
LINK = re.compile(r"(?<!`)\[[^\]\n]*\]\(([^)\s]+)\)")
CITED = re.compile(r"\bdocs/[A-Za-z0-9_./-]+\.(?:md|yml|yaml|json)\b")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        out.add(slug)
    return out


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
            continue  # http(s), mailto: not checked offline
        path, _sep, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or REPO not in dest.parents and dest != REPO:
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_cited_docs_path_exists() -> None:
    sources = [*PAGES, *(REPO / "docs" / "prometheus").glob("*.yml"), *(REPO / "inventories").rglob("*.yml"),
               *(REPO / "playbooks").rglob("*.yml"), *(REPO / "roles").rglob("*.yml")]
    missing = sorted({f"{src.relative_to(REPO)}: {cited}" for src in sources
                      for cited in CITED.findall(src.read_text(encoding="utf-8")) if not (REPO / cited).exists()})
    assert not missing, missing


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title here\n\nSee [a](missing.md), [b](#title-here), [c](#nope) and `[d](x.md)`.\n", encoding="utf-8")
    assert links(page) == ["missing.md", "#title-here", "#nope"]
    assert anchors(page) == {"title-here"}
