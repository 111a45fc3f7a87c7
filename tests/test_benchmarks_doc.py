"""docs/BENCHMARKS.md is an overview (a headline table, one row per claim with the command
that prints it, and the list of pages); each area's tables live on its page under
docs/benchmarks/. Checked here: every page and section the overview links to exists, no
section is left unlinked, every section and headline row names a command, and every script,
figure and page a benchmarks page names is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERVIEW = ROOT / "docs" / "BENCHMARKS.md"
PAGES = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
COMMAND = re.compile(r"(python3? (-m thinwire\.\S+|benchmarks/\S+)|bash benchmarks/\S+|"
                     r"(^|[`\s(])thinwire (bench|compare|train|plan|theory|report|testbed)\b|"
                     r"make (demo|test|bench)\b)", re.M)


def slug(title: str) -> str:
    """The anchor a markdown renderer gives a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def sections(path: Path) -> dict[str, str]:
    """``## `` heading -> its text, headings inside code blocks left out."""
    out: dict[str, str] = {}
    fence, current = False, None
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("## "):
            current = line[3:].strip()
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def test_the_overview_links_every_section_of_every_page() -> None:
    text = OVERVIEW.read_text()
    linked = set(re.findall(r"\]\(benchmarks/([\w.\-]+\.md)#([\w\-]+)\)", text))
    assert PAGES, "docs/benchmarks/ holds the pages"
    for page in PAGES:
        assert f"](benchmarks/{page.name})" in text, f"{page.name} is not linked from the overview"
        for title in sections(page):
            assert (page.name, slug(title)) in linked, f"{page.name}: '{title}' is not linked"
    for name, anchor in linked:
        page = ROOT / "docs" / "benchmarks" / name
        assert page.is_file(), f"the overview links to a missing page {name}"
        assert anchor in {slug(t) for t in sections(page)}, f"{name}#{anchor} is no section"


def test_every_section_and_headline_row_names_its_command() -> None:
    for page in PAGES:
        for title, body in sections(page).items():
            assert COMMAND.search(body), f"{page.name}: '{title}' names no command"
    rows = [ln for ln in sections(OVERVIEW)["Headline figures"].splitlines()
            if ln.startswith("|") and not re.match(r"\|\s*-", ln)][1:]
    assert len(rows) >= len(PAGES), "at least one headline row a page"
    for row in rows:
        assert COMMAND.search(row.split("|")[-2]), f"a headline row names no command: {row}"


def test_the_scripts_figures_and_pages_named_exist() -> None:
    for page in [OVERVIEW, *PAGES]:
        text = page.read_text()
        for script in set(re.findall(r"\bbenchmarks/([\w\-]+\.(?:py|sh))", text)):
            assert (ROOT / "benchmarks" / script).is_file(), f"{page.name} names {script}"
        for link in re.findall(r"\]\(([^)#\s]+\.(?:png|md|svg))", text):
            if "://" not in link:
                assert (page.parent / link).resolve().is_file(), f"{page.name} links {link}"
