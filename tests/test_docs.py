"""The documentation holds together: README is a front door (<= 250 lines), every relative link in
README.md and docs/ resolves to a file and, with an anchor, to a heading of it, and every config
key of the schema is mentioned somewhere in docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bigtrain.config.load import all_keys
from tests.conftest import ROOT

pytestmark = pytest.mark.unit

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (code blocks left out)."""
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#+ (.*)", line)):
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")


def fence_problems(page: Path) -> list[str]:
    """Code fences that do not pair up: one left open at the end of the page, or a closing
    fence with text after it (Markdown then keeps the fence open, and the rest of the page
    renders as code)."""
    problems, opened = [], None  # opened: (fence, line number)
    for number, line in enumerate(page.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if m is None:
            continue
        fence, rest = m.groups()
        if opened is None:
            opened = (fence, number)
        elif fence[0] == opened[0][0] and len(fence) >= len(opened[0]):
            if rest.strip():
                problems.append(f"{page.name}:{number}: text after a closing fence")
            opened = None
    if opened is not None:
        problems.append(f"{page.name}:{opened[1]}: a fence never closed")
    return problems


def test_every_code_fence_is_closed():
    problems = [p for page in PAGES for p in fence_problems(page)]
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no heading)")
    assert not broken, "\n".join(broken)


def test_every_config_key_is_in_the_docs():
    text = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    leaves = [k for k in all_keys() if not any(o.startswith(k + ".") for o in all_keys())]
    missing = [k for k in leaves if k not in text]
    assert not missing, f"{len(missing)} config keys not in docs/: {missing[:20]}"


def test_the_config_reference_is_current():
    from bigtrain.config.docs import reference_markdown

    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert page == reference_markdown(), (
        "docs/config-reference.md is out of date: python -m bigtrain.config.docs > "
        "docs/config-reference.md"
    )
