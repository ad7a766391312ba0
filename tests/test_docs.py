"""The documentation holds together: README.md stays a short front page, every page under docs/ is
in mkdocs.yml's navigation, every relative link points at a file (and heading) that exists, and
the site builds with warnings as errors (mkdocs.yml turns broken anchors into warnings)."""

import re
import subprocess
import sys
from pathlib import Path

import markdown
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 260

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def nav_pages(nav: list) -> set[str]:
    """The file names a mkdocs nav lists, at any depth:
    [{"Overview": "index.md"}, {"Part": [{"A": "a.md"}]}] -> {"index.md", "a.md"}."""
    pages = set()
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def relative_links(page: Path) -> list[str]:
    """Links in a page's text, outside code, that are neither absolute URLs nor mail addresses."""
    text = INLINE_CODE.sub("", FENCED.sub("", page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def heading_ids(page: Path) -> set[str]:
    """The anchors mkdocs gives a page's headings (the same toc extension, the same slugs)."""
    md = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
    md.convert(page.read_text())
    ids, tokens = set(), list(md.toc_tokens)
    while tokens:
        token = tokens.pop()
        ids.add(token["id"])
        tokens.extend(token["children"])
    return ids


def test_readme_is_a_front_page():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; move detail to docs/"


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = nav_pages(config["nav"])
    on_disk = {p.name for p in doc_pages()}
    assert on_disk - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - on_disk == set(), "nav entries with no page"


def test_relative_links_point_at_existing_files_and_headings():
    broken = []
    for page in [README, *doc_pages()]:
        for target in relative_links(page):
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in heading_ids(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_site_builds_with_warnings_as_errors(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(result.stdout, result.stderr)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists()
