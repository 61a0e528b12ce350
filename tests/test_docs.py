"""Every relative link and image in the documents a reader opens resolves to a file of the repository.

The documents: README.md, CONTRIBUTING.md, ARCHITECTURE.md, CHANGELOG.md and every page of docs/. A link is
``[text](target)``, ``![alt](target)``, a reference definition ``[name]: target``, or an HTML ``src=`` /
``href=``; text in code (fenced blocks and inline spans) is not a link. Links with a scheme (``https:``,
``mailto:``) are not checked. An anchor into a markdown page (``file.md#anchor``, or ``#anchor`` for the page
itself) must be one of that page's headings, as GitHub spells their anchors. A target must be a file or
folder in the repository as a fresh clone has it: inside the repository, and tracked by git when the tree is
a git checkout (a plot that ``make demo`` writes into an ignored folder exists only on the machine that ran
it).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("README.md", "CONTRIBUTING.md", "ARCHITECTURE.md", "CHANGELOG.md")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HTML_ATTRIBUTE = re.compile(r"\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t#]*$", re.MULTILINE)
LINK_TEXT = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def documents() -> list[Path]:
    return [ROOT / name for name in TOP_LEVEL] + sorted((ROOT / "docs").glob("*.md"))


def prose(text: str, inline_code: bool = False) -> str:
    """The text with code blocked out: fenced blocks become empty lines and (unless inline_code) inline spans
    become spaces, so that line numbers stay and nothing in code reads as a link or a heading."""
    lines = []
    fence = None
    for line in text.split("\n"):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(line if inline_code else INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line))
    return "\n".join(lines)


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in a markdown text, code excluded."""
    body = prose(text)
    found = []
    for pattern in (INLINE_LINK, REFERENCE, HTML_ATTRIBUTE):
        for match in pattern.finditer(body):
            found.append((body.count("\n", 0, match.start(1)) + 1, match.group(1)))
    return sorted(found)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown page's headings: the heading's text without link targets and
    backticks, lower case, with everything but letters, digits, '_', '-' and spaces dropped and each space a
    '-'; a repeated anchor gets '-1', '-2', ... in order. Headings inside fenced code are not headings."""
    found: set[str] = set()
    for match in HEADING.finditer(prose(text, inline_code=True)):
        slug = re.sub(r"[^\w\- ]", "", LINK_TEXT.sub(r"\1", match.group(1)).replace("`", "").lower())
        slug = slug.replace(" ", "-")
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def tracked_files() -> set[str] | None:
    """Every path git tracks in this checkout (repository-relative, '/'-separated), or None outside git."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.decode().split("\0")) - {""} or None  # none: a tree git does not track (an unpacked sdist)


def broken_reason(document: Path, target: str, tracked: set[str] | None, root: Path = ROOT) -> str | None:
    """Why target, as written in document (a page of the repository at root), does not resolve; None when
    it does, or when it is not checked."""
    if not target:
        return "empty target"
    if SCHEME.match(target):
        return None
    path_part, _, fragment = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    if not path_part:
        resolved = document.resolve()
    else:
        base = root if path_part.startswith("/") else document.parent
        resolved = (base / path_part.lstrip("/")).resolve()
    if not resolved.is_relative_to(root):
        return "outside the repository"
    if not resolved.exists():
        return "no such file"
    if tracked is not None:
        relative = resolved.relative_to(root).as_posix()
        if resolved.is_file() and relative not in tracked:
            return "not tracked by git (a fresh clone lacks it)"
        if resolved.is_dir() and relative != "." and not any(p.startswith(relative + "/") for p in tracked):
            return "no tracked file in this folder (a fresh clone lacks it)"
    if fragment and resolved.suffix == ".md":
        if unquote(fragment) not in anchors(resolved.read_text(encoding="utf-8")):
            return f"no heading with the anchor #{fragment}"
    return None


def broken_links(document: Path, tracked: set[str] | None) -> list[str]:
    name = document.relative_to(ROOT).as_posix()
    problems = []
    for line, target in links(document.read_text(encoding="utf-8")):
        reason = broken_reason(document, target, tracked)
        if reason is not None:
            problems.append(f"{name}:{line}: {target} ({reason})")
    return problems


TRACKED = tracked_files()


@pytest.mark.parametrize("document", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_image_resolves_to_a_repository_file(document):
    assert document.is_file(), f"{document.relative_to(ROOT)} is missing"
    problems = broken_links(document, TRACKED)
    assert not problems, "\n".join(problems)


def test_the_link_finder_sees_links_images_references_and_html_but_not_code():
    text = "\n".join(
        [
            "See [the maths](docs/math.md#derivation) and ![a plot](img/plot.png 'title').",
            "A [link whose text",
            "wraps](docs/scaling.md), and [x]:  refs/target.md",
            "[ref]: docs/ref.md",
            '<img src="img/html.png"> <a href="https://example.com">web</a>',
            "`[not a link](in/code.md)` ``[nor](this.md)``",
            "```bash",
            "echo [nor](fenced.md)",
            "```",
            "~~~~",
            "[nor](tilde.md)",
            "```",
            "~~~~",
            "[after](the/fences.md)",
        ]
    )
    assert links(text) == [
        (1, "docs/math.md#derivation"),
        (1, "img/plot.png"),
        (3, "docs/scaling.md"),
        (4, "docs/ref.md"),
        (5, "https://example.com"),
        (5, "img/html.png"),
        (14, "the/fences.md"),
    ]


def test_a_missing_untracked_outside_or_unanchored_target_is_reported_and_the_others_are_not(tmp_path):
    root = tmp_path.resolve()
    (root / "docs" / "img").mkdir(parents=True)
    (root / "src").mkdir()
    (root / "README.md").write_text("# ropekit\n\n## Usage\n")
    (root / "CHANGELOG.md").write_text("")
    (root / "LICENSE").write_text("")
    (root / "docs" / "img" / "a.png").write_bytes(b"")
    (root / "docs" / "math.md").write_text(
        "# Maths\n\n## Why HF permutes Meta's `q`/`k` [weights](x.md)\n\n## Usage\n\n## Usage\n"
        "```\n## Not a heading\n```\n"
    )
    readme, page = root / "README.md", root / "docs" / "math.md"
    tracked = {"README.md", "docs/math.md", "docs/img/a.png", "LICENSE"}

    def reason(document, target, tracked=tracked):
        return broken_reason(document, target, tracked, root)

    assert reason(readme, "docs/math.md") is None
    assert reason(readme, "docs/math.md#why-hf-permutes-metas-qk-weights") is None
    assert reason(readme, "docs/math.md#usage-1") is None  # GitHub numbers a repeated heading
    assert reason(page, "img/a.png") is None
    assert reason(page, "../LICENSE") is None
    assert reason(readme, "/docs/math.md") is None  # GitHub: a leading '/' is the repository's root
    assert reason(readme, "docs") is None
    assert reason(readme, "#usage") is None
    assert reason(readme, "https://example.com/missing.md") is None
    assert reason(readme, "docs/nothing-here.md") == "no such file"
    assert reason(readme, "docs/nothing-here.md#usage") == "no such file"
    assert reason(readme, "../outside.md") == "outside the repository"
    assert reason(readme, "#no-such-heading") == "no heading with the anchor #no-such-heading"
    assert reason(readme, "docs/math.md#usage-2") == "no heading with the anchor #usage-2"
    assert reason(readme, "docs/math.md#not-a-heading") == "no heading with the anchor #not-a-heading"
    assert reason(readme, "CHANGELOG.md") == "not tracked by git (a fresh clone lacks it)"
    assert reason(readme, "src") == "no tracked file in this folder (a fresh clone lacks it)"
    assert reason(readme, "CHANGELOG.md", tracked=None) is None  # outside git only existence is checked
    assert reason(readme, "") == "empty target"


def test_the_readme_links_every_page_of_docs():
    linked = {
        (ROOT / target.partition("#")[0]).resolve()
        for _, target in links((ROOT / "README.md").read_text(encoding="utf-8"))
        if not SCHEME.match(target)
    }
    pages = sorted((ROOT / "docs").glob("*.md"))
    unlinked = [page.relative_to(ROOT).as_posix() for page in pages if page.resolve() not in linked]
    assert not unlinked, f"README.md links no page {unlinked}"
