"""The packages' layers, as docs/architecture.md draws them: `attention` and `kvstore` at the
bottom, `workers` above them, `cluster` on top; inside `cluster`, `cluster.engine` (one replica's
engine) at the bottom, `cluster.api` (HTTP) above it, the Ray orchestration at `cluster/`'s top,
the benchmarks above all. Every import that runs is read, those inside functions included (a
lazy import still ties two modules together), and the graph must have no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cluster", "workers", "attention", "kvstore")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations, never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(path: Path) -> set[str]:
    """Every module `path` imports when it runs, at any depth of its code (lazy imports inside
    functions included; those under `if TYPE_CHECKING:` are annotations only)."""
    tree = ast.parse(path.read_text())
    pkg = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    skip = _type_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def _cycles(graph: dict[str, set[str]], within: str | None = None) -> list[list[str]]:
    """The strongly connected components of more than one module among `within.*` (all modules
    when None; Tarjan)."""
    nodes = [m for m in graph if within is None or m == within or m.startswith(within + ".")]
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere():
    assert _cycles(_graph()) == []


# Which packages each package may import (the rest of the project is above it).
PACKAGE_MAY_IMPORT = {"attention": set(), "kvstore": set(), "workers": {"attention", "kvstore"},
                      "cluster": {"workers", "attention", "kvstore"}}


def test_packages_import_only_the_packages_below_them():
    bad = sorted({f"{m} imports {d}" for m, deps in _graph().items() for d in deps
                  if d.split(".")[0] != m.split(".")[0]
                  and d.split(".")[0] not in PACKAGE_MAY_IMPORT[m.split(".")[0]]})
    assert bad == [], bad


def test_the_cycle_finder_finds_one():
    assert _cycles({"cluster.a": {"cluster.b"}, "cluster.b": {"cluster.a"}, "cluster.c": {"cluster.a"}},
                   "cluster") == [["cluster.a", "cluster.b"]]


def _layer(module: str) -> str:
    for sub in ("engine", "api", "bench"):
        if module.startswith(f"cluster.{sub}.") or module == f"cluster.{sub}":
            return sub
    return "orchestration" if module.startswith("cluster.") else module.split(".")[0]


# What each layer of cluster/ may import from cluster/ (besides itself).
MAY_IMPORT = {"engine": set(), "api": {"engine"}, "orchestration": {"engine", "api"},
              "bench": {"engine", "api", "orchestration"}}


def test_each_layer_imports_only_the_layers_below_it():
    graph = _graph()
    bad = []
    for m, deps in graph.items():
        if not m.startswith("cluster."):
            continue
        layer = _layer(m)
        for d in deps:
            if d.startswith("cluster.") and _layer(d) != layer and _layer(d) not in MAY_IMPORT[layer]:
                bad.append(f"{m} ({layer}) imports {d} ({_layer(d)})")
    # The CLI, the entry point of every command, is the one module that reaches up to the
    # benchmarks (`manta bench`).
    bad = [b for b in bad if not (b.startswith("cluster.cli ") and b.endswith("(bench)"))]
    assert bad == [], bad


def test_only_the_orchestration_layer_of_cluster_imports_ray():
    found = []
    for sub in ("engine", "api"):
        for p in (ROOT / "cluster" / sub).rglob("*.py"):
            found += [f"{_module(p)} imports {i}" for i in _imports(p) if i == "ray" or i.startswith("ray.")]
    assert found == [], found


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):  # names defined under a guard still exist
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.ClassDef):
                    names.add(sub.name)
                elif isinstance(sub, ast.Import | ast.ImportFrom):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return names


def test_every_import_of_our_packages_resolves():
    """After modules move, an import left pointing at the old place fails here, on a CPU, even
    where only CUDA machines would run it (Triton kernels are imported on the GPU only)."""
    bad = []
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")] + sorted((ROOT / "tests").glob("*.py"))
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                mods = [(node.module, a.name) for a in node.names]
            for mod, name in mods:
                if mod.split(".")[0] not in PACKAGES:
                    continue
                base = ROOT.joinpath(*mod.split("."))
                pkg_init, module_file = base / "__init__.py", base.with_suffix(".py")
                if module_file.exists():
                    ok = name is None or name == "*" or name in _top_level_names(module_file)
                elif pkg_init.exists():
                    ok = (name is None or (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()
                          or name in _top_level_names(pkg_init))
                else:
                    ok = False
                if not ok:
                    bad.append(f"{p.relative_to(ROOT)}: {mod}" + (f" import {name}" if name else ""))
    assert bad == [], bad
