"""The documentation holds together: the generated reference is what its module writes, and every relative link in
the README, ARCHITECTURE.md, docs/, bench/README.md and router/README.md reaches a file (and a heading there, for
`#anchor` links)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from commands import reference

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "bench" / "README.md", ROOT / "router" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]  # fmt: skip

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")


def links(text: str) -> list[str]:
    """The targets of a page's markdown links, code blocks and code spans left out."""
    return _LINK.findall(_CODE.sub("", _FENCE.sub("", text)))


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens; repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_reference_is_what_its_module_writes():
    written = (ROOT / "docs" / "reference.md").read_text()
    assert written == reference.write(), f"docs/reference.md is out of date: run `{reference.REGENERATE}`"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_heading(page: Path):
    text = page.read_text()
    broken = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_link_reader_finds_links_and_anchors():
    assert links("see [a](x.md#y), ![img](p.png) and `[not](code.md)`") == ["x.md#y", "p.png"]
    assert anchors("# On a GPU (issue 31: built)\n## The `llama.cpp` build\n## A\n## A") == {
        "on-a-gpu-issue-31-built",
        "the-llamacpp-build",
        "a",
        "a-1",
    }


def test_architecture_names_every_module_of_every_package() -> None:
    """ARCHITECTURE.md goes one level below the README's map: each package's modules, every one of them named."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    packages = sorted(p.parent for p in ROOT.glob("*/__init__.py") if p.parent.name not in ("tests", "bench"))
    missing = [
        f"{m.parent.name}/{m.name}"
        for pkg in packages
        for m in sorted(pkg.glob("*.py"))
        if m.name != "__init__.py" and f"`{m.name}`" not in text
    ]
    assert not missing, f"modules ARCHITECTURE.md does not name: {missing}"
