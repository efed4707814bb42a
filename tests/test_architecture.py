"""docs/architecture.md matches the code: its module map names every module of the product,
once, with the first paragraph of that module's docstring, and every source path the page
mentions exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("node", "engines", "storage")


def product_modules() -> set[str]:
    """Every product module as a path relative to the repository (Alembic's revision scripts
    are data of the migrations package, not modules a reader navigates)."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "versions" not in path.parts and "__pycache__" not in path.parts
    }


def module_map() -> dict[str, str]:
    """The doc's module map: path -> the text after it."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    entries: dict[str, str] = {}
    for line in section.splitlines():
        match = re.match(r"- `([\w/]+\.py)`: (.+)$", line)
        if match:
            assert match[1] not in entries, f"{match[1]} is listed twice"
            entries[match[1]] = match[2]
    return entries


def first_paragraph(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def test_module_map_lists_every_module_and_only_those() -> None:
    listed, actual = set(module_map()), product_modules()
    assert not actual - listed, f"modules missing from docs/architecture.md: {actual - listed}"
    assert not listed - actual, (
        f"docs/architecture.md lists modules that do not exist: {listed - actual}"
    )


def test_module_map_says_what_each_docstring_says() -> None:
    stale = {
        path: (said, first_paragraph(ROOT / path))
        for path, said in module_map().items()
        if (ROOT / path).is_file() and said != first_paragraph(ROOT / path)
    }
    assert not stale, f"docs/architecture.md differs from the docstrings: {stale}"


def test_every_source_path_the_page_names_exists() -> None:
    text = DOC.read_text(encoding="utf-8")
    named = set(
        re.findall(r"\b((?:node|engines|storage|tests|bench|scripts)/[\w/]*\w(?:\.py)?)\b", text)
    )
    missing = sorted(
        p for p in named if not (ROOT / p).exists() and not (ROOT / f"{p}.py").exists()
    )
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
