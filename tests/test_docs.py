"""The README and docs/ point only at what exists: every relative link and every experiment named; no
control character (a backspace from a Python string) stands in a page."""

import re

from tests.conftest import ROOT

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_and_experiment_in_the_docs_exists():
    pages = [p for p in PAGES if p.exists()]
    assert len(pages) >= 15, [str(p) for p in pages]  # the README and the topic and results pages
    missing, links = [], 0
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            links += 1
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
        names = re.findall(r"experiment=([a-z][a-z0-9_]*)", text) + re.findall(r"experiments/([a-z][a-z0-9_]*)", text)
        for name in names:  # (experiment=NAME is a placeholder)
            if not (ROOT / "experiments" / f"{name}.yaml").exists():
                missing.append(f"{page.relative_to(ROOT)}: experiment={name}")
    assert links > 20, links
    assert not missing, missing


def test_no_page_holds_a_control_character():
    """A `\\b` written from a Python string lands as a backspace: docs/rewards.md showed `oxed{}` for
    `\\boxed{}` in five places until this test."""
    found = [f"{page.relative_to(ROOT)}:{n}: {line!r}" for page in PAGES if page.exists()
             for n, line in enumerate(page.read_text().splitlines(), 1) if re.search(r"[\x00-\x08\x0b-\x1f\x7f]", line)]
    assert not found, found
