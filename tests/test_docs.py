"""README.md and docs/*.md: every relative link reaches an existing file (and heading), and CI runs the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    # GitHub's heading slugs: lower case, punctuation dropped, spaces to hyphens (code fences skipped)
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def test_docs_exist_and_link_each_other() -> None:
    assert len(PAGES) > 10, PAGES
    readme_targets = {(ROOT / t.split("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= readme_targets, "every docs/*.md page is linked from the README's table"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(page: Path) -> None:
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.relative_to(ROOT)}: link {target!r} points to a missing file"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.relative_to(ROOT)}: link {target!r}: no such heading"


def test_ci_runs_the_readme_test_command() -> None:
    readme_block = re.search(r"^# 3\. run the tests\n(.+)$", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert readme_block, "README's quickstart block lost its test command"
    command = readme_block.group(1).strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci_lines[-1] == command, (ci_lines[-1], command)
