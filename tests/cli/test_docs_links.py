"""Every relative link in README.md and docs/**/*.md leads somewhere: to a file or folder of this
checkout and, where it names a #anchor in a Markdown file, to a heading (or an `<a id>`) there, by
GitHub's anchor rules. Pure Python, no server."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
HTML_ANCHOR = re.compile(r"""<a\s+(?:[^>]*?\s)?(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), with an optional "title"; <target> may hold spaces
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")
LINE_ANCHOR = re.compile(r"^L\d+(?:-L\d+)?$")  # GitHub's anchors into a code file's lines


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fence = [], ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line[m.end():].strip():
                fence = ""
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text lowercased, punctuation dropped
    (letters, digits, `_`, `-` and spaces stay), each space a '-'."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file has: its headings' (a repeated one gets -1, -2, ...) and `<a id>`s."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text()):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in the file's prose (not in code blocks or code spans)."""
    out = []
    for n, line in prose_lines(path.read_text()):
        line = INLINE_CODE.sub("", line)
        targets = [m.group(1) for m in LINK.finditer(line)]
        ref = REFERENCE.match(line)
        if ref:
            targets.append(ref.group(1))
        out.extend((n, t[1:-1] if t.startswith("<") else t) for t in targets)
    return out


def broken(path: Path) -> list[str]:
    """What is wrong with the file's relative links, one line each."""
    problems = []
    for n, target in links(path):
        if EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(ROOT)}:{n}: ({target})"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where} leads out of the repository")
        elif not dest.exists():
            problems.append(f"{where}: no such file {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix.lower() == ".md":
            if anchor not in anchors(dest):
                problems.append(f"{where}: {dest.relative_to(ROOT)} has no heading or anchor #{anchor}")
        elif anchor and not (dest.is_file() and LINE_ANCHOR.match(anchor)):
            problems.append(f"{where}: #{anchor} in a file that has no anchors")
    return problems


def test_every_relative_link_leads_to_a_file_and_heading_that_exist() -> None:
    files = pages()
    assert len(files) > 2 and all(f.exists() for f in files), files
    assert sum(len(links(f)) for f in files) > 20, "the checker finds (almost) no links: is it reading the pages?"
    problems = [p for f in files for p in broken(f)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_docs_index_lists_every_page() -> None:
    index = DOCS / "README.md"
    listed = {(index.parent / unquote(t.partition("#")[0])).resolve() for _, t in links(index)
              if not EXTERNAL.match(t)}
    missing = [str(p.relative_to(ROOT)) for p in sorted(DOCS.rglob("*.md")) if p != index and p not in listed]
    assert not missing, f"docs/README.md does not list {missing}"


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Running a feed", "running-a-feed"),
    ("Options of `run`", "options-of-run"),
    ("Set up (a fresh machine with Python 3.11+ and Java 17+)", "set-up-a-fresh-machine-with-python-311-and-java-17"),
    ("Failover of the source (PostgreSQL 17 and later)", "failover-of-the-source-postgresql-17-and-later"),
    ("`alter` and `snapshot`", "alter-and-snapshot"),
    ("A [linked](other.md#x) heading: *emphasis*, snake_case", "a-linked-heading-emphasis-snake_case"),
])
def test_anchors_follow_githubs_rules(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_the_checker_finds_what_is_broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## Twice\n\n## Twice\n\n<a id=\"kept\"></a>\n")
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#twice-1) [ok](other.md#kept) [ok](#page) [ok](https://example.com/#x) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n# not a heading\n```\n"
        "[gone](nowhere.md) [no heading](other.md#twice-2) [no anchor](#not-a-heading)\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    problems = broken(page)
    assert len(problems) == 3, problems
    assert "no such file nowhere.md" in problems[0]
    assert "#twice-2" in problems[1] and "#not-a-heading" in problems[2]


def test_every_option_of_every_command_is_documented() -> None:
    """Each command's options appear (as `--option`) in the docs or the README."""
    from changefeed.cli import parser

    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    sub = next(a for a in parser()._actions if a.dest == "command")
    missing = sorted({f"{name} {opt}" for name, cmd in sub.choices.items()  # type: ignore[union-attr]
                      for action in cmd._actions for opt in action.option_strings
                      if opt.startswith("--") and opt != "--help" and f"`{opt}" not in docs
                      and f"{opt} " not in docs})
    assert not missing, f"options not in README.md or docs/: {missing}"
