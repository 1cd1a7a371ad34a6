"""The documentation holds together: the README stays a page, every docs page is reachable
from it, and no relative link is broken (files, and `#anchors` into Markdown files as
GitHub slugs their headings). Pure file reading: no processes, no network."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "benchmarks" / "README.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), an optional "title" after the target.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text without fenced code blocks (where a link is not a link)."""
    return FENCE.sub("", text)


def links(page: Path) -> list[str]:
    return LINK.findall(INLINE_CODE.sub("", prose(page.read_text())))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped
    (letters, digits, `_` and `-` stay), spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading's anchor in `page`, repeats numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def problems(page: Path) -> list[str]:
    found = []
    for target in links(page):
        if SCHEME.match(target):
            continue  # http(s), mailto: not ours to check
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            found.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            found.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return found


def test_the_readme_is_a_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_the_readme_keeps_the_commands_ci_and_the_server_tests_read() -> None:
    text = README.read_text()
    assert ".venv/bin/python -m pytest -q" in text  # .ci/run runs the README's command
    # tests/server/test_server_openai.py runs this block against a real server.
    assert re.search(r"```sh\n(curl -N http://127\.0\.0\.1:8000.*?)\n```", text, re.S)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README) if not SCHEME.match(t)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert page.exists()
    assert not problems(page), "\n".join(problems(page))


def test_the_slugs_are_githubs() -> None:
    assert slug("`gpu_check.py`: the one call that verifies the GPU path") == (
        "gpu_checkpy-the-one-call-that-verifies-the-gpu-path"
    )
    assert slug("Faults, recovery, and overload") == "faults-recovery-and-overload"
    assert slug("Plan: 8x A100-80GB SXM, OPT-13B") == "plan-8x-a100-80gb-sxm-opt-13b"


def test_every_setting_is_in_the_settings_table() -> None:
    """docs/settings.md names every setting by its dotted name (a row may hold several)."""
    from appliance.settings.config import Settings
    from appliance.settings.flags import settings_flags

    page = (ROOT / "docs" / "settings.md").read_text()
    rows = "\n".join(line for line in page.splitlines() if line.startswith("|"))
    names = {flag.key for flag in settings_flags(Settings)}
    missing = sorted(name for name in names if not re.search(rf"\b{re.escape(name)}\b", rows))
    assert not missing, f"docs/settings.md has no row for {missing}"
