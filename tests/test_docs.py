"""The README and docs/ as a reader meets them: every relative link and image resolves, and the
README's first example runs as it is written."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

import hvdmagic

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target), the target without a title; code spans are taken out first.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_HEADING = re.compile(r"^#{1,6} +(.*?) *#*$", re.M)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found: set[str] = set()
    for heading in _HEADING.findall(text):
        slug, n = _slug(heading.replace("`", "")), 1
        while slug in found:  # GitHub numbers a repeated heading's anchor: -1, -2, ...
            slug = f"{_slug(heading.replace('`', ''))}-{n}"
            n += 1
        found.add(slug)
    return found


@pytest.mark.unit
def test_every_relative_link_and_image_in_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        for target in _LINK.findall(_CODE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # a web address: not checked here (the tests have no network)
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.mark.unit
def test_the_docs_index_lists_every_page_and_the_readme_stays_short():
    index = (REPO / "docs" / "index.md").read_text()
    unlisted = [page.name for page in PAGES[1:] if page.name != "index.md" and f"({page.name})" not in index]
    assert not unlisted, f"docs/index.md does not list {unlisted}"
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 160, f"the README has {lines} lines: what is not for a newcomer belongs in docs/"


def readme_example() -> list[str]:
    """The code cells of the README's "A first cell", in order."""
    text = (REPO / "README.md").read_text()
    section = text.split("## A first cell", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_s_first_example_runs_as_written(ip):
    cells = readme_example()
    assert len(cells) == 2 and cells[1].startswith("%%horovod --np -2\n"), cells
    for cell in cells:
        outcome = ip.run_cell(cell)
        assert outcome.error_before_exec is None and outcome.error_in_exec is None, outcome
    run = hvdmagic.last_run()
    assert run.state == "finished" and run.np == 2, run
    loss = outcome.result
    assert isinstance(loss, float) and loss < 0.05, f"the ranks' mean loss after training: {loss}"
    metrics = run.metrics
    assert len(metrics[metrics["rank"] == 0]) == 300, metrics  # rank 0 logged every step
    assert metrics["loss"].iloc[0] > 10 * loss, metrics  # and it fell
