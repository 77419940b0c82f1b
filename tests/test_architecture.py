"""The package's floor plan holds: layer contracts, no private names across packages, no hidden imports."""

import ast
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvpack"
# Function-level imports of kvpack modules are allowed only where the imported module needs Triton
# (an optional dependency): the launchers stay importable without it.
TRITON_MODULES = {"anchor_decode", "puzzle_decode", "puzzle_ragged_decode", "split_merge", "chunk_attend",
                  "pca_quant_decode"}  # modules that import Triton: imported where a Triton path runs


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield path, name, ast.parse(path.read_text(), filename=str(path))


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _subpackage(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2])


def test_no_private_name_is_imported_across_packages():
    offenders = []
    for path, module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, node, path.name == "__init__.py")
                if not target.startswith("kvpack") or _subpackage(target) == _subpackage(module):
                    continue
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                private += [target] if any(p.startswith("_") for p in target.split(".")[1:]) else []
                if private:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {private} from {target}")
    assert not offenders, "\n".join(offenders)


def test_no_function_level_imports_of_kvpack_modules():
    """Imports sit at the top of a module; a function-level import used to hide an import cycle."""
    offenders = []
    for path, module, tree in _modules():
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    target = _resolve(module, node, path.name == "__init__.py")
                    if target.startswith("kvpack") and target.rsplit(".", 1)[-1] not in TRITON_MODULES:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target} inside {fn.name}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.skipif(shutil.which("lint-imports") is None or importlib.util.find_spec("importlinter") is None,
                    reason="import-linter is not installed (pip install -e '.[lint]')")
def test_layer_contracts_hold():
    run = subprocess.run(["lint-imports", "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def _import_graph() -> dict[str, set[str]]:
    """``{module: kvpack modules it imports}``, every import statement counted (module level or inside a
    function, ``from . import x`` resolved to the submodule where ``x`` is one)."""
    modules = list(_modules())  # each file parsed once
    names = {name for _, name, _ in modules}
    graph: dict[str, set[str]] = {}
    for path, module, tree in modules:
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, node, path.name == "__init__.py")
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in names else base)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
        graph[module] = {t for t in targets if t in names and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules (first == last), or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a"}}) is None


def test_no_import_cycle_anywhere_in_the_package():
    """Function-level imports count: they only hide a cycle (the chunk op and its Triton kernel once
    imported each other that way)."""
    cycle = find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_among_the_benchmark_scripts():
    """The benchmarks import each other by module name (their folder is the script's path); the frontier's plan
    and the peers' scripts once imported each other."""
    scripts = {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, tree in scripts.items():
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                targets.update(a.name.split(".")[0] for a in node.names)
        graph[name] = {t for t in targets if t in scripts and t != name}
    assert any(graph.values())  # the scripts do import each other (the walk sees them)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
