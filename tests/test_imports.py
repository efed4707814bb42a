"""The product is one package, ``segnode``, whose modules import each other without cycles.

Every ``import`` and ``from ... import`` that runs (at module level or inside a function;
not those under ``if TYPE_CHECKING:``, which only the type checker follows) is an edge from
the importing module to the imported one. A cycle means two modules that cannot be
understood, tested or moved apart; the ones that used to hide behind function-level imports
count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("node", "engines", "storage")


def module_name(path: Path) -> str:
    """``node/pipeline/worker.py`` -> ``segnode.node.pipeline.worker`` (``segnode/node`` links to
    ``node/``)."""
    parts = ("segnode", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.Module, name: str, package: bool) -> set[str]:
    """Modules that ``tree`` imports when it runs (TYPE_CHECKING blocks left out)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if package else 0)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used = runtime_imports(tree, name, path.name == "__init__.py")
        graph[name] = {m for m in used if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_function_level_imports_and_skips_type_checking() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from a import b\nelse:\n    import c\n"
        "def f():\n    from d import e\n"
        "from . import sibling\n"
    )
    used = runtime_imports(tree, "pkg.mod", package=False)
    assert {"c", "d", "d.e", "pkg", "pkg.sibling"} <= used and "a" not in used
    assert cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 40 and graph["segnode.node.ops.service"]  # the walk found the modules
    assert cycles(graph) == []


def test_only_segnode_is_imported() -> None:
    """Importing the node's entry points loads no top-level ``node``, ``engines`` or
    ``storage`` module (the names that used to collide in site-packages) and no fixture."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import segnode.node.ops.cli, segnode.node.ops.service, segnode.engines.trained\n"
        "import segnode.storage.ledger\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules}"
        " & {'node', 'engines', 'storage', 'tests'})\n"
        "sys.exit(f'imported: {bad}' if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    """The built wheel's only top-level package is ``segnode`` (with the node's, the engines'
    and the storage's files under it, the bundled model and the web console's files
    included) and its entry point is ``segnode.node.ops.cli:main``."""
    import subprocess
    import sys
    import zipfile

    # pip builds in an isolated environment with the build-system requirements of
    # pyproject.toml (a venv's own setuptools may be older than they say)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = tmp_path.glob("segnode-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"segnode"}
    for expected in (
        "segnode/node/ops/cli.py",
        "segnode/engines/trained.py",
        "segnode/storage/spool.py",
        "segnode/engines/models/tissue/tissue.json",
        "segnode/node/web/static/index.html",
    ):
        assert expected in names, expected
    assert not any(n.startswith(("segnode/tests", "tests/")) for n in names)
    [entry] = [n for n in names if n.endswith("entry_points.txt")]
    assert "segnode = segnode.node.ops.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
