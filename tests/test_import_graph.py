"""The house's shape: no import circles among flce_policy's modules, and few modules at its top level.

Read from the source with ``ast`` (nothing imported): every package setuptools installs, the
``package-dir``-mapped ones (``strategies/`` as ``flce_policy.strategies``, ``kernels/``, ...) included.
An edge is any import of one of those modules, at module level or inside a function (a deferred import
that closes a circle is a circle all the same); one under ``if TYPE_CHECKING:`` is not, since it never
runs. ``from package import name`` is an edge to the submodule when ``name`` is one, else to the package.
That importing a submodule first runs its parent package's ``__init__`` is Python's, not an edge.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
#: flce_policy/'s top level: the public surface and the front door; everything else in its rooms.
MAX_TOP_LEVEL_MODULES = 10
#: The front door, and the rooms below it: a call goes down through them and nothing comes back up to it.
FRONT_DOOR = "flce_policy.loss"
BELOW_THE_FRONT_DOOR = (
    "flce_policy.plan", "flce_policy.strategies", "flce_policy.engine", "flce_policy.kernels", "flce_policy.call",
    "flce_policy.distributed",
)  # fmt: skip


def package_dirs() -> dict[str, Path]:
    """Each installed package and its folder, as setuptools maps them (pyproject's packages and package-dir)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools.get("package-dir", {})
    dirs = {}
    for package in setuptools["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):  # the longest mapped prefix, as setuptools resolves it
            prefix = ".".join(parts[:cut])
            if prefix in mapping:
                dirs[package] = REPO / mapping[prefix] / Path(*parts[cut:])
                break
        else:
            dirs[package] = REPO / Path(*parts)
    return dirs


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in package_dirs().items():
        files[package] = folder / "__init__.py"
        for path in folder.glob("*.py"):
            if path.name != "__init__.py":
                files[f"{package}.{path.stem}"] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_modules(tree: ast.Module, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules among ``modules`` that the code imports, skipping ``if TYPE_CHECKING:`` bodies."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from package import submodule` imports the submodule; `from module import name`, the module
            names.update(f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names)
    found = set()
    for name in names:
        while name and name not in modules:  # `import a.b.c`: the deepest of our modules it spells
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = _imported_modules(tree, module, path.name == "__init__.py", set(files))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_covers_every_room():
    """The walk sees the mapped packages and real edges (so that an empty graph cannot pass the next test)."""
    graph = import_graph()
    assert {"flce_policy.strategies.registry", "flce_policy.kernels.driver", "flce_policy.cli.tune"} <= set(graph)
    assert "flce_policy.call.plan" in graph["flce_policy.loss"]
    assert "flce_policy.kernels.driver_call" in graph["flce_policy.kernels.vocab_tiled"]  # a deferred import counts
    assert "flce_policy.kernels.vocab_shard" not in graph["flce_policy.kernels.ce_kernel"]  # TYPE_CHECKING only


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def reaching(graph: dict[str, set[str]], target: str) -> dict[str, list[str]]:
    """Each module whose imports lead to ``target``, with one chain ``[module, ..., target]`` that does."""
    chains = {target: [target]}
    changed = True
    while changed:
        changed = False
        for module, imported in sorted(graph.items()):
            if module not in chains and (via := next((m for m in sorted(imported) if m in chains), None)):
                chains[module] = [module, *chains[via]]
                changed = True
    del chains[target]
    return chains


def test_reaching_follows_chains():
    graph = {"a": {"b"}, "b": {"door"}, "c": {"d"}, "d": set(), "door": {"c"}}
    assert reaching(graph, "door") == {"a": ["a", "b", "door"], "b": ["b", "door"]}


def test_nothing_below_the_front_door_leads_back_to_it():
    """The front door tells a call's story top-down: no module of the rooms below imports it, directly or
    through another module (the integrations, say)."""
    graph = import_graph()
    below = [m for m in graph if m.startswith(tuple(f"{room}." for room in BELOW_THE_FRONT_DOOR))]
    assert {"flce_policy.call.plan", "flce_policy.distributed.route", "flce_policy.kernels.driver"} <= set(below)
    back = {module: chain for module, chain in reaching(graph, FRONT_DOOR).items() if module in below}
    assert not back, "back up to the front door: " + "; ".join(" -> ".join(chain) for chain in back.values())


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_every_package_folder_is_installed():
    """A subpackage left out of pyproject's packages would be missing from the wheel (and from this graph)."""
    listed = {folder.resolve() for folder in package_dirs().values()}
    for folder in listed:
        for init in folder.rglob("__init__.py"):
            assert init.parent.resolve() in listed, f"{init.parent} is a package not listed in pyproject.toml"


def test_few_modules_at_the_top_level():
    top = sorted(path.name for path in (REPO / "flce_policy").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at flce_policy/'s top level: {top}"
