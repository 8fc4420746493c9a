"""The package's modules import one another one way: no import circle, and a project import inside a function
only where loading a heavy optional dependency for every caller would cost (each says why, ``# lazy: ...``).

A circle makes the import order decide which names exist (a partly initialised module), and an import hidden in
a function hides a dependency from the reader and from ``tests/test_dvc_deps.py``'s picture of what a stage
runs. The graph is read statically (``ast``) from every module of ``splatflow/``, imports inside functions
included (they close circles as well); imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAZY_MARK = "# lazy:"


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/package``."""
    out = {}
    for p in sorted((root / package).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module that importing ``name`` runs last: ``name`` itself, or the nearest package holding it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, modules: dict[str, Path], package: str) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for every project import of ``module`` that runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for c in child.orelse:
                    visit(c, in_function)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name == package or a.name.startswith(package + "."):
                        found.append((_resolve(a.name, modules), child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = here[:len(here) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                if name == package or name.startswith(package + "."):
                    for a in child.names:  # `from pkg import mod` imports the module, not an attribute
                        full = f"{name}.{a.name}"
                        found.append((full if full in modules else _resolve(name, modules), child.lineno,
                                      in_function))
            visit(child, inner)

    visit(tree, False)
    return [(m, line, fn) for m, line, fn in found if m is not None and m != module]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file)."""
    modules = _modules(root, package)
    return {m: {t for t, _, _ in _imports(m, p, modules, package)} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                found = dfs(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = dfs(v)
            if found:
                return found
    return None


def test_no_import_cycle_in_splatflow():
    cycle = find_cycle(import_graph(REPO, "splatflow"))
    assert cycle is None, ("import circle: " + " -> ".join(cycle) + "; move what both sides need into a module "
                           "below them (as splatflow.compress.scoring sits below splatflow.compress.prune and "
                           "splatflow.train)")


def test_function_level_project_imports_say_why():
    modules = _modules(REPO, "splatflow")
    unexplained = []
    for m, p in modules.items():
        lines = p.read_text().split("\n")
        for target, line, in_function in _imports(m, p, modules, "splatflow"):
            if in_function and not any(LAZY_MARK in lines[i] for i in (line - 2, line - 1) if i >= 0):
                unexplained.append(f"{p.relative_to(REPO)}:{line} imports {target}")
    assert not unexplained, ("imports inside functions without a reason; move them to the top of the module, or "
                             f"say on the line (or the line above) `{LAZY_MARK} <the heavy dependency it "
                             "avoids loading>`:\n" + "\n".join(sorted(set(unexplained))))


def test_the_checker_finds_a_circle_and_a_hidden_import(tmp_path):
    """The checks above can fail: a package whose circle is closed inside a function is caught, a one-way one
    passes."""
    pkg = tmp_path / "demo_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from demo_pkg.sub.b import g\n")
    (pkg / "a.py").write_text("from demo_pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import x\n    return x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo_pkg import a\n")
    graph = import_graph(tmp_path, "demo_pkg")
    assert graph["demo_pkg.c"] == set()  # type-checking imports never run
    cycle = find_cycle(graph)
    assert cycle is not None and set(cycle) == {"demo_pkg.a", "demo_pkg.sub.b"}
    modules = _modules(tmp_path, "demo_pkg")
    assert _imports("demo_pkg.sub.b", modules["demo_pkg.sub.b"], modules, "demo_pkg") == [("demo_pkg.a", 2, True)]
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, "demo_pkg")) is None
