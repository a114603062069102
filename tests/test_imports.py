"""The runtime's Python modules import one way: no module reaches, directly or through
others, back to itself (function-level imports count: a lazy import is still an arrow).
The compiler is above the runtime, so no runtime module imports it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "spyre_rt"


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, known: set[str]) -> str | None:
    """The module (or package) of ours that `name` names, if any."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _arrows() -> dict[str, set[str]]:
    files = {_module_of(p): p for p in ROOT.rglob("*.py")}
    known = set(files) | {"spyre_rt._native"}  # the C extension: a module of its own, not the package
    arrows: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import name`: the submodule pkg.name if there is one, else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                target = _resolve(t, known)
                if target and target != module:
                    arrows[module].add(target)
    return arrows


def _cycle(arrows: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(arrows.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(arrows):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_runtime_has_no_import_cycle():
    cycle = _cycle(_arrows())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_runtime_never_imports_the_compiler():
    offenders = {m for m, targets in _arrows().items() for t in targets if t.startswith("spyre_rt.compiler")}
    assert not offenders, offenders


# Entry points another framework loads on its own (vLLM's platform plugin): they import the
# package to register the device, as a user's code does, and nothing of ours imports them.
ENTRY_POINTS = {"spyre_rt.serving", "spyre_rt.serving.worker"}


def test_nothing_beneath_the_package_imports_its_init():
    """spyre_rt/__init__ registers the device from every layer: it is the top."""
    arrows = _arrows()
    offenders = {m for m, targets in arrows.items() if "spyre_rt" in targets} - ENTRY_POINTS
    assert not offenders, offenders
    assert not {m for m, targets in arrows.items() if targets & ENTRY_POINTS} - ENTRY_POINTS - {"spyre_rt"}


# The compiler's modules outside compiler/inductor/ that use torch's internals (names with a
# leading underscore): docs/ARCHITECTURE.md names them, for whoever upgrades torch.
TORCH_INTERNALS_OUTSIDE_INDUCTOR = {"backend", "errors", "prebuild", "options"}


def test_the_compilers_torch_internals_are_where_the_architecture_says():
    compiler = ROOT.parent / "compiler"
    users = set()
    for path in compiler.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.startswith("torch.") and any(part.startswith("_") for part in n.split(".")) for n in names):
                users.add(path.stem)
    assert users == TORCH_INTERNALS_OUTSIDE_INDUCTOR


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
