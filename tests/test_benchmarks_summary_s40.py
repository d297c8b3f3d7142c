"""benchmarks/README.md's summary stays one screen, each headline a sentence or two (issue 54 item 5); the body goes by
topic: its ``##`` sections are topics (memory, speed, context, quality, ...), not rounds or sessions."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "benchmarks" / "README.md"
SCREEN_LINES = 45  # a terminal or a rendered page without scrolling
MAX_HEADLINE = 250  # characters: two sentences of the table's width


def _summary_rows(text: str) -> tuple[list[str], list[list[str]]]:
    summary = text.split("\n## Summary\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in summary.splitlines() if line.startswith("| ") and not line.startswith("| what |")]
    return summary.splitlines(), [[cell.strip() for cell in row.strip().strip("|").split(" | ")] for row in rows]


def test_the_summary_is_one_screen_of_short_headlines() -> None:
    lines, rows = _summary_rows(README.read_text())
    assert len(lines) <= SCREEN_LINES, f"the summary is {len(lines)} lines: one headline per measurement, details in its section"
    assert rows and all(len(row) == 3 for row in rows), "a row is | what | headline figure | section |"
    long = [f"{row[0]}: {len(row[1])} characters" for row in rows if len(row[1]) > MAX_HEADLINE]
    assert long == [], f"headlines over {MAX_HEADLINE} characters (move the detail to the section linked)"


def test_the_body_goes_by_topic() -> None:
    sections = re.findall(r"^## (.+)$", README.read_text(), flags=re.MULTILINE)
    by_round = [s for s in sections if re.search(r"\b(session|round|issue)\b", s, flags=re.IGNORECASE)]
    assert sections[0] == "Summary" and sections[-1].startswith("Archive") and by_round == [], sections


def test_the_check_catches_a_long_headline() -> None:
    text = "# B\n\n## Summary\n\n| what | headline figure | section |\n|---|---|---|\n| x | " + "y" * 300 + " | [s](#s) |\n\n## Body\n"
    _, rows = _summary_rows(text)
    assert len(rows) == 1 and len(rows[0][1]) > MAX_HEADLINE
