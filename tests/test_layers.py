"""The package's shape: sub-packages in layers, each importing only the layers below it, and no
import cycle anywhere (imports inside functions count: a lazy import that hides a cycle is one)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "longstraw"

# bottom to top; a sub-package may import its own modules and any sub-package of a lower layer
LAYERS = [
    {"results"},
    {"config", "measure", "plotting", "wheels"},
    {"kernels"},
    {"state", "models"},
    {"families"},
    {"cp"},
    {"core"},
    {"training", "peers"},
    {"kinds"},
    {"harness"},
    {"report"},
    {"cli", "__init__"},
    {"__main__"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """Every `longstraw...` module a file imports, at any depth of its code (`from pkg import
    module` imports that module; `from module import name`, the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("longstraw")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("longstraw"):
            for alias in node.names:
                inner = f"{node.module}.{alias.name}"
                found.add(inner if _is_module(inner) else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_subpackage_has_a_layer():
    names = {_subpackage(m) for m in _graph()}
    assert names <= set(LAYER), f"sub-packages without a layer: {sorted(names - set(LAYER))}"


def test_imports_only_go_down_the_layers():
    upward = [
        (m, d)
        for m, deps in _graph().items()
        for d in deps
        if _subpackage(d) != _subpackage(m) and LAYER[_subpackage(d)] >= LAYER[_subpackage(m)]
    ]
    assert not upward, "imports of a layer not below the importer's: " + ", ".join(f"{m} -> {d}" for m, d in upward)


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_check_finds_a_planted_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The walker is not vacuous: a lazy import that closes a loop, and one that goes up, are found."""
    pkg = tmp_path / "longstraw"
    (pkg / "state").mkdir(parents=True)
    (pkg / "core").mkdir()
    for folder in (pkg, pkg / "state", pkg / "core"):
        (folder / "__init__.py").write_text("")
    (pkg / "state" / "pages.py").write_text("def f():\n    from longstraw.core.step import g\n")
    (pkg / "core" / "step.py").write_text("from longstraw.state.pages import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    graph = _graph()
    assert graph["longstraw.state.pages"] == {"longstraw.core.step"}
    assert graph["longstraw.core.step"] == {"longstraw.state.pages"}
    try:
        test_no_import_cycles()
    except AssertionError as exc:
        assert "longstraw.core.step -> longstraw.state.pages -> longstraw.core.step" in str(exc)
    else:
        raise AssertionError("the planted cycle was not found")
    try:
        test_imports_only_go_down_the_layers()
    except AssertionError as exc:
        assert "longstraw.state.pages -> longstraw.core.step" in str(exc)
    else:
        raise AssertionError("the planted upward import was not found")
