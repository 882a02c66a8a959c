"""Every relative link of the README and the guides in docs/ leads somewhere.

A link's file must exist in the repository, and a ``#fragment`` into a markdown file must
name one of its headings (GitHub's anchors: lower case, punctuation dropped, spaces to
hyphens, ``-1``, ``-2`` for repeats). Links in code blocks and code spans are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`+[^`\n]*`+")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:


def prose(text: str) -> str:
    """The text without fenced code blocks, and code spans replaced by a placeholder."""
    return _CODE_SPAN.sub("code", _FENCE.sub("", text))


def anchors(markdown: str) -> set[str]:
    """The heading anchors GitHub makes for a markdown text."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", markdown)):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_anchors_follow_githubs_rules() -> None:
    text = "# A `b=1` (c) §5\n## A `b=1` (c) §5\n```\n# not a heading\n```\n"
    assert anchors(text) == {"a-b1-c-5", "a-b1-c-5-1"}


def test_there_are_guides_to_check() -> None:
    names = {page.name for page in PAGES}
    assert {"README.md", "protocol.md"} <= names and len(names) > 3


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _LINK.findall(prose(page.read_text())):
        if _EXTERNAL.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif (
            fragment
            and destination.suffix == ".md"
            and fragment not in anchors(destination.read_text())
        ):
            broken.append(f"{target}: no heading #{fragment} in {destination.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
