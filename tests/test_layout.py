"""The package's architecture, checked from its sources (docs/architecture.md): no import
cycles among megatron_mok's modules (imports inside functions count too), imports point
one way between the rooms, and no module calls another module's private functions."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_mok"

# Rooms, from the bottom up: a module may import its own room and the rooms below it.
SPEC = {"reference", "activations", "mxfp8", "validation", "config", "knobs", "routing_errors",
        "stacked"}
ORDER = ("spec", "functional", "kernels", "megatron")  # kernels sit under functional's API,
# but the kernel backend reads the shared workspace/schedule types: see room_of().


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set) -> set:
    """megatron_mok modules that `name` imports anywhere in its file."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in known:
                    out.add(full)
                elif base in known:
                    out.add(base)
    out.discard(name)
    # A package's __init__ is imported before any of its modules: not an edge of its own.
    return {m for m in out if not name.startswith(m + ".")}


def graph() -> dict:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def room_of(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] in ("megatron", "pretrain_gpt"):
        return "megatron"
    if parts[1] == "kernels":
        return "kernels"
    if parts[1] in SPEC:
        return "spec"
    return "functional"


def test_no_import_cycles():
    g = graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(g[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node)


def test_rooms_import_one_way():
    """The spec imports no other room; the kernels never import the functional API
    (megatron_mok.functional) or the Megatron adapter; only the adapter imports megatron."""
    bad = []
    for name, deps in graph().items():
        room = room_of(name)
        for dep in deps:
            dep_room = room_of(dep)
            if room == "spec" and dep_room not in ("spec", "package"):
                bad.append((name, dep))
            if room == "kernels" and (dep == "megatron_mok.functional" or dep_room == "megatron"):
                bad.append((name, dep))
            if room in ("functional", "kernels", "spec") and dep_room == "megatron":
                bad.append((name, dep))
    assert not bad, f"imports against the rooms' direction: {bad}"


def test_no_private_names_across_modules():
    """`from megatron_mok.x import _private` and `module._private(...)` on an imported
    megatron_mok module: private functions stay inside their module."""
    g = graph()
    mods = modules()
    bad = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_mok"):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name != "_C":
                        bad.append((name, f"{node.module}.{alias.name}"))
                    full = f"{node.module}.{alias.name}"
                    if full in mods:
                        aliases[alias.asname or alias.name] = full
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append((name, f"{aliases[node.value.id]}.{node.attr}"))
    assert not bad, f"private names used across modules: {bad}"
    assert g  # the scan found the package's modules


def test_no_undefined_names():
    """pyflakes over the package: a misspelt name in a GPU-only path
    (the tuner, the megakernels' wrappers) fails here, on the CPU, not on the GPU machine."""
    api = pytest.importorskip("pyflakes.api")
    reporter_mod = pytest.importorskip("pyflakes.reporter")
    import io
    out = io.StringIO()
    reporter = reporter_mod.Reporter(out, out)
    # (benchmarks/ is left out: pyflakes misreads their closures over loop variables that
    # are deleted at the end of each iteration)
    for path in sorted(PACKAGE.rglob("*.py")):
        api.checkPath(str(path), reporter)
    undefined = [line for line in out.getvalue().splitlines() if "undefined name" in line]
    assert not undefined, "\n".join(undefined)
