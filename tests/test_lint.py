"""The package's shape, enforced: the layered import contract (import-linter), no import cycle,
no module inside importing the public face ``kvbridge`` itself, and function-level imports of the
package only where they defer an optional dependency (with a comment naming it)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvbridge"
#: The package modules that may be imported inside a function: each loads an optional dependency.
DEFERRED = {
    "kvbridge.backends.native": "numba",
    "kvbridge.backends.native._kernels": "the C extension",
    "kvbridge.backends.triton_kernels": "triton",
    "kvbridge.backends.triton_digest": "triton",
}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return out


def _package_imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvbridge"):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.startswith("kvbridge")]
    return found


def test_layered_import_contract():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.fail("lint-imports is missing: pip install -e '.[test]' installs import-linter")
    run = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_nothing_inside_imports_the_face():
    modules = _modules()
    for name, tree in modules.items():
        if name == "kvbridge":
            continue
        for line, module, names in _package_imports(tree):
            assert module != "kvbridge" or all(f"kvbridge.{n}" in modules for n in names), (
                f"{name}:{line} imports the public face kvbridge ({names or 'the package'}); import the module "
                "that defines the name")


def test_no_import_cycle():
    modules = _modules()
    edges = {name: set() for name in modules}
    for name, tree in modules.items():
        for _, module, names in _package_imports(tree):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            edges[name] |= {t for t in targets if t in modules and t != name}
    seen: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(edges[node]):
            if nxt == "kvbridge" or name_is_parent(nxt, node):
                continue
            assert seen.get(nxt) != 1, "import cycle: " + " -> ".join([*path[path.index(nxt):], nxt])
            if nxt not in seen:
                visit(nxt, [*path, nxt])
        seen[node] = 2

    def name_is_parent(parent: str, child: str) -> bool:
        return child.startswith(parent + ".")

    for name in sorted(modules):
        if name not in seen:
            visit(name, [name])


def test_function_level_imports_only_defer_optional_dependencies():
    sources = {p: p.read_text().split("\n") for p in PACKAGE.rglob("*.py")}
    for path, lines in sources.items():
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for line, module, names in _package_imports(fn):
                targets = [f"{module}.{n}" for n in names] if names else [module]
                where = f"{path.relative_to(ROOT)}:{line}"
                assert any(t in DEFERRED or module in DEFERRED for t in targets), (
                    f"{where}: a function-level import of {module}; import it at the top of the module")
                assert "#" in lines[line - 1], f"{where}: say which optional dependency this import defers"
