"""pipeline/ is built in floors: a module may import from its own floor or the floors below, never
from above, and no chain of imports may come back to where it started.

Why: a low module that reaches up (config reading the data layer, say) drags
the upper floor's imports, and its import-time cost, into everything that uses the low one, and is
how import cycles start; a cycle makes which module finishes initialising first depend on who is
imported first. An import inside a function counts the same as one at the top of the file: it runs
as soon as that function does, and it is the usual way a cycle is hidden rather than removed.

The imports are read with `ast`, nothing is executed: `import pipeline.x`, `from pipeline.x import y`
and relative imports (`from ..x import y`, resolved against the importing module's package), at any
depth of the file. `from package import name` is an import of `package.name` when that is a module of
the tree, else of `package`. Imports by computed name (`importlib.import_module`) are not seen: the
stage modules are found that way (from __main__ or stages/, never from below floor 8), the
registries of functions chosen by name import the modules that register the built-in ones so
(pipeline/registries.py's HOMES, higher floors, as the stage registry finds the stages), and config
imports the user's reward-function module (not pipeline's) so.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"

# The allowed order, lowest floor first. Each name is a module or sub-package under pipeline/ (a
# dotted name such as "stages.registry" places one module apart from its package; the most specific
# name wins); "__init__" is pipeline/__init__.py itself, which every import of the package runs, so
# it stays on the ground floor. Every module of the tree must be placed, and every name must match a
# module: a new top-level module fails the test until its name is added to
# a floor here; a new module inside a listed sub-package (pipeline/stages/registry.py) takes its
# package's floor with no change.
LAYERS: list[set[str]] = [
    {"__init__", "context", "devices", "errors", "files", "progress", "registries", "tasks"},   # 1: no pipeline imports but each other's
    {"config"},                                     # 2: params and their checks
    {"data", "workflow"},                           # 3: reading and tokenising inputs; the DVC/Snakemake side
    {"models"},                                     # 4
    {"preference", "tracking"},                     # 5
    {"measurement", "training"},                    # 6: neither imports the other (both take a Context from floor 1)
    {"ppo"},                                        # 7
    {"stages"},                                     # 8
    {"__main__"},                                   # 9: the command line
]

# Today's violations, exactly: (importer, imported) module pairs. The real tree's set must equal this,
# so a new violation fails the test and a fixed one fails it too until its pair is deleted here.
KNOWN: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str    # dotted module name, e.g. "pipeline.config"
    imported: str    # dotted module name of the tree
    where: str       # "pipeline/config.py:731"
    nested: bool     # inside a function or class body, not at module level


@dataclass(frozen=True)
class Violation:
    kind: str        # "upward" or "cycle"
    importer: str
    imported: str
    message: str     # names the file:line and both modules


def modules(package: Path) -> dict[str, Path]:
    """Every module of the package tree under `package`, by dotted name (a package is its __init__.py)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _nested_nodes(tree: ast.Module) -> set[int]:
    """ids of the import nodes inside a function or class body (for the message only)."""
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            inner |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inner


def imports(package: Path) -> list[Import]:
    """Every import, at any depth, from a module of the tree to a module of the tree."""
    mods = modules(package)
    root = package.parent
    top = package.name
    found = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        nested = _nested_nodes(tree)
        # The package a relative import is resolved against: the module's own name for an __init__.py.
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    if node.level - 1 >= len(parts):
                        raise AssertionError(f"{path.relative_to(root)}:{node.lineno}: relative import "
                                             f"beyond the top-level package")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    module = f"{base}.{node.module}" if node.module else base
                else:
                    module = node.module or ""
                # `from package import name`: the submodule when there is one, else the package's namespace.
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            for target in dict.fromkeys(targets):
                if target != top and not target.startswith(top + "."):
                    continue
                # `import pipeline.x.y.z` where z is a name, not a module: the longest prefix that is a module.
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target != name:
                    found.append(Import(name, target, f"{path.relative_to(root)}:{node.lineno}", id(node) in nested))
    return found


def floor_of(module: str, top: str, layers: list[set[str]]) -> int | None:
    """The index in `layers` of the most specific name covering `module`, or None when none does."""
    rel = "__init__" if module == top else module.removeprefix(top + ".")
    best, depth = None, -1
    for i, layer in enumerate(layers):
        for entry in layer:
            if (rel == entry or rel.startswith(entry + ".")) and entry.count(".") > depth:
                best, depth = i, entry.count(".")
    return best


def placement_problems(package: Path, layers: list[set[str]]) -> list[str]:
    """Modules no floor names, names on two floors, and names that match no module."""
    top = package.name
    mods = modules(package)
    problems = [f"{path.relative_to(package.parent)}: module {name} is on no floor of LAYERS"
                for name, path in mods.items() if floor_of(name, top, layers) is None]
    seen: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for entry in sorted(layer):
            if entry in seen:
                problems.append(f"LAYERS names {entry!r} on floors {seen[entry] + 1} and {i + 1}")
            seen[entry] = i
            full = top if entry == "__init__" else f"{top}.{entry}"
            if not any(m == full or m.startswith(full + ".") for m in mods):
                problems.append(f"LAYERS floor {i + 1} names {entry!r}, which is no module of {top}/")
    return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    work: list = []   # the nodes being visited, each with the children it has still to look at
    out = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)   # the order of first visits
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(sorted(edges.get(node, ())))))

    for start in sorted(edges):
        if start in index:
            continue
        visit(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    visit(child)
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _shortest_path(src: str, dst: str, edges: dict[str, set[str]], inside: set[str]) -> list[str]:
    """A shortest import chain src -> ... -> dst through the modules of `inside` (breadth-first)."""
    came_from = {src: src}
    todo = [src]
    while todo and dst not in came_from:
        reached = []
        for node in todo:
            for child in sorted(edges.get(node, ()) & inside):
                if child not in came_from:
                    came_from[child] = node
                    reached.append(child)
        todo = reached
    path = [dst]
    while path[-1] != src:
        path.append(came_from[path[-1]])
    return path[::-1]


def violations(package: Path, layers: list[set[str]]) -> list[Violation]:
    """Every import that runs up the floors, and every import that lies on a cycle (module-level and
    function-level imports together), each with its file:line."""
    top = package.name
    found = imports(package)
    mods = modules(package)
    out = []
    for imp in found:
        a, b = floor_of(imp.importer, top, layers), floor_of(imp.imported, top, layers)
        if a is not None and b is not None and b > a:
            scope = "inside a function" if imp.nested else "at module level"
            out.append(Violation("upward", imp.importer, imp.imported,
                                 f"{imp.where}: {imp.importer} (floor {a + 1}) imports {imp.imported} "
                                 f"(floor {b + 1}) {scope}"))
    edges: dict[str, set[str]] = {m: set() for m in mods}
    lines: dict[tuple[str, str], list[str]] = {}
    for imp in found:
        edges[imp.importer].add(imp.imported)
        lines.setdefault((imp.importer, imp.imported), []).append(imp.where)
    for component in _cycles(edges):
        inside = set(component)
        # Every import between two modules of one component lies on a cycle: each is reported, with
        # the shortest cycle through it, every hop at its file:line.
        for a in component:
            for b in sorted(edges[a] & inside):
                chain = [a, *_shortest_path(b, a, edges, inside)]
                hops = ", ".join(f"{lines[m, n][0]} {m} -> {n}" for m, n in zip(chain, chain[1:]))
                extra = f" (one of {len(component)} modules that reach each other)" if len(component) > len(chain) - 1 else ""
                out.append(Violation("cycle", a, b, f"{', '.join(lines[a, b])}: {a} imports {b}, closing an import "
                                                     f"cycle of {len(chain) - 1} modules: {hops}{extra}"))
    return out


def report(found: list[Violation]) -> str:
    """One line per violation, the upward imports first: a cycle is usually closed by one of them."""
    return "\n".join(v.message for v in sorted(found, key=lambda v: (v.kind != "upward", v.message)))


def test_pipeline_imports_follow_the_floors_and_make_no_cycle():
    """The real tree: every module placed, and the violations exactly KNOWN's."""
    assert placement_problems(PACKAGE, LAYERS) == []
    found = violations(PACKAGE, LAYERS)
    pairs = {(v.importer, v.imported) for v in found}
    new = [v for v in found if (v.importer, v.imported) not in KNOWN]
    assert not new, "imports against the floors of tests/unit/test_layers.py LAYERS:\n" + report(new)
    fixed = KNOWN - pairs
    assert not fixed, f"no longer violations, delete them from KNOWN in tests/unit/test_layers.py: {sorted(fixed)}"
    assert pairs == KNOWN


def test_the_checker_reports_upward_imports_and_cycles(tmp_path):
    """A small tree with one of each fault, and the clean imports beside them, shows the rule can
    fail: an upward import inside a function, a two-module cycle made of one module-level and one
    function-level import within a floor, a longer cycle across floors, and a module on no floor."""
    files = {
        "__init__.py": "",
        "base.py": "import os\n",
        "low/__init__.py": "from . import a\n",
        "low/a.py": "from ..base import x\n\ndef f():\n    from ..high import top\n",          # upward, in a function
        "low/b.py": "from . import c\n",                                                    # b <-> c
        "low/c.py": "def g():\n    import fake.low.b\n",
        "mid.py": "from .low import b\nfrom fake.low.c import y\n",                         # down: allowed
        "high/__init__.py": "",
        "high/top.py": "from ..mid import z\nfrom . import loop\n",                         # down, and within a floor
        "high/loop.py": "from .. import base\n",
        "cyc1.py": "from .cyc2 import q\n",                                                  # cyc1 -> cyc2 -> cyc1 (same floor)
        "cyc2.py": "from fake import cyc1\n",
        "stray.py": "",
    }
    package = tmp_path / "fake"
    for rel, text in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    layers = [{"__init__", "base"}, {"low", "cyc1", "cyc2"}, {"mid"}, {"high"}, {"gone"}]

    assert placement_problems(package, layers) == [
        "fake/stray.py: module fake.stray is on no floor of LAYERS",
        "LAYERS floor 5 names 'gone', which is no module of fake/",
    ]
    found = violations(package, layers)
    by_kind = {(v.kind, v.importer, v.imported) for v in found}
    assert by_kind == {
        ("upward", "fake.low.a", "fake.high.top"),
        ("cycle", "fake.low.b", "fake.low.c"),
        ("cycle", "fake.low.c", "fake.low.b"),
        ("cycle", "fake.cyc1", "fake.cyc2"),
        ("cycle", "fake.cyc2", "fake.cyc1"),
    }, report(found)
    messages = {(v.kind, v.importer, v.imported): v.message for v in found}
    assert messages["upward", "fake.low.a", "fake.high.top"] == \
        "fake/low/a.py:4: fake.low.a (floor 2) imports fake.high.top (floor 4) inside a function"
    assert messages["cycle", "fake.low.c", "fake.low.b"] == \
        "fake/low/c.py:2: fake.low.c imports fake.low.b, closing an import cycle of 2 modules: " \
        "fake/low/c.py:2 fake.low.c -> fake.low.b, fake/low/b.py:1 fake.low.b -> fake.low.c"

    # Now the upward import closes a cycle as well: low.a -> high.top -> mid -> low.a.
    (package / "high/top.py").write_text("from ..mid import z\n")
    (package / "mid.py").write_text("from .low.a import w\n")
    found = violations(package, layers)
    cycle = {(v.importer, v.imported) for v in found if v.kind == "cycle"}
    assert {("fake.low.a", "fake.high.top"), ("fake.high.top", "fake.mid"), ("fake.mid", "fake.low.a")} <= cycle
    assert any(v.kind == "upward" and v.importer == "fake.low.a" for v in found)
    assert next(v.message for v in found if v.kind == "cycle" and v.importer == "fake.mid") == \
        "fake/mid.py:1: fake.mid imports fake.low.a, closing an import cycle of 3 modules: " \
        "fake/mid.py:1 fake.mid -> fake.low.a, fake/low/a.py:4 fake.low.a -> fake.high.top, " \
        "fake/high/top.py:1 fake.high.top -> fake.mid"
