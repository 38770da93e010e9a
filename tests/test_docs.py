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


def recipe_rows() -> dict[str, list[str]]:
    """docs/configs.md's recipe table: the cells of each row by config file name."""
    rows = {}
    for line in (ROOT / "docs" / "configs.md").read_text().splitlines():
        if m := re.match(r"^\| `configs/([\w.-]+\.yaml)` \|(.*)\|$", line):
            rows[m.group(1)] = [cell.strip() for cell in m.group(2).split("|")]
    return rows


def shown(count: int, text: str) -> bool:
    """`text` ("1.07M", "405.85B") is `count` rounded as it shows it."""
    number, unit = text[:-1], text[-1]
    decimals = len(number.partition(".")[2])
    return round(count / {"M": 1e6, "B": 1e9}[unit], decimals) == float(number)


def test_every_recipe_has_a_row_with_its_parameter_count():
    """Every configs/*.yaml in the recipe table, its parameters (and an MoE model's active ones)
    as its config builds them."""
    from bigtrain.config import load_config
    from bigtrain.plan.experts import count_experts
    from bigtrain.plan.shapes import count_params, meta_model

    rows = recipe_rows()
    assert sorted(rows) == sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    wrong = []
    for name, cells in rows.items():
        cfg = load_config([str(ROOT / "configs" / name)])
        model = meta_model(cfg.model, cfg.data)
        total, active = count_params(model)[0], None
        if (experts := count_experts(model)) is not None:
            active = experts.active
        m = re.fullmatch(r"([\d.]+[MB])(?:, ([\d.]+[MB]) active)?", cells[1])
        if m is None or not shown(total, m.group(1)) or (m.group(2) is None) != (active is None):
            wrong.append(f"{name}: {cells[1]!r}, built {total:,} (active {active})")
        elif active is not None and not shown(active, m.group(2)):
            wrong.append(f"{name}: {cells[1]!r}, built {active:,} active")
    assert not wrong, "\n".join(wrong)


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
