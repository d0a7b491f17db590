"""The package's layers: core, sandbox ← rollout, models, tasks, report ← config, endpoint ← train ←
workflows ← api ← trl ← cli; and inside tasks its rooms: the floor ← rewards, tools ←
ecosystems, builtin.

No module imports from a layer above its own, modules of one middle layer do not import each
other's packages, and there is no import cycle inside a package either (a cycle is where a
change in one file silently needs another)."""

from __future__ import annotations

import ast
from pathlib import Path

import grouprl

ROOT = Path(grouprl.__file__).parent
#: Each part of the package and its layer; a module may import its own layer's part and lower
#: layers. errors, faults, images and messages are shared helpers everyone may use.
LAYERS = {
    "errors": 0, "faults": 0, "images": 0, "messages": 0, "quiet": 0,
    "core": 1, "sandbox": 1,
    "rollout": 2, "models": 2, "tasks": 2, "report": 2, "explain": 2,
    "config": 3, "endpoint": 3,
    "train": 4,
    "workflows": 5,
    "api": 6,
    "trl": 7,
    "cli": 8, "__main__": 9,
}  # fmt: skip


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


PACKAGES = {
    ".".join(("grouprl", *p.parent.relative_to(ROOT).parts)) for p in ROOT.rglob("__init__.py")
}


def _imports() -> dict[str, set[str]]:
    """Every grouprl module and the grouprl modules it imports (at any depth of its code)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("grouprl", *path.relative_to(ROOT).with_suffix("").parts))
        name = name.removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)  # and `from package import module` names a module:
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m == "grouprl" or m.startswith("grouprl.")}
    return graph


def test_no_import_runs_up_the_layers_or_across_a_middle_layer():
    for module, imported in _imports().items():
        part = _part(module)
        if part == "__init__":
            continue
        for target in imported:
            other = _part(target)
            assert other in LAYERS, f"{target} (imported by {module}) has no layer"
            assert LAYERS[other] <= LAYERS[part], f"{module} imports {target}, a higher layer"
            assert LAYERS[other] < LAYERS[part] or other == part or LAYERS[part] == 0, (
                f"{module} imports {target}, another part of its own layer"
            )


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """An import cycle among `edges` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module, [])):
            return found
    return None


def test_no_import_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # it can fail
    graph = _imports()
    # a package's __init__ only re-exports its modules: edges into it are not cycle steps
    edges = {
        m: {t for t in targets if t in graph and t not in PACKAGES and t != m}
        for m, targets in graph.items()
    }
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def _modules_under(prefix: str) -> dict[str, set[str]]:
    return {m: t for m, t in _imports().items() if m == prefix or m.startswith(prefix + ".")}


def test_configuration_imports_no_report_and_parallelism_no_training():
    """The config reads no tracker module (their names are its own), and the parallel room
    (Dist, FSDP) knows nothing of the training batch or loop: only itself below train."""
    for module, imported in _modules_under("grouprl.config").items():
        assert not any(t.startswith("grouprl.report") for t in imported), module
    for module, imported in _modules_under("grouprl.train.parallel").items():
        training = [t for t in imported if t.startswith("grouprl.train.")
                    and not t.startswith("grouprl.train.parallel")]  # fmt: skip
        assert not training, (module, training)


def test_commands_live_in_cli_and_no_module_is_over_600_lines():
    """A command (flag parsing, printing, exit statuses) is a module of grouprl.cli; the library
    below it parses no argv; no module grows past 600 lines."""
    parsers = ("tyro", "argparse")
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 600, relative
        if relative.parts[0] in ("cli", "config"):
            continue
        tree = ast.parse(text)
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module}  # fmt: skip
        assert not imported & set(parsers), (relative, imported & set(parsers))
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), (
            relative
        )


def test_no_function_is_over_80_lines():
    """A function longer than a screen hides its steps: split it (docstring included)."""
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines})")
    assert not long, long


#: The rooms of grouprl.tasks and their floors (a module of the package itself is on floor 0).
TASK_ROOMS = {"rewards": 1, "tools": 1, "ecosystems": 2, "builtin": 2}


def _task_room(module: str) -> str | None:
    """The room of a grouprl.tasks module ("" for the package's own modules), None outside."""
    parts = module.split(".")
    if parts[:2] != ["grouprl", "tasks"] or len(parts) == 2:
        return None
    return parts[2] if parts[2] in TASK_ROOMS else ""


def test_the_rooms_of_tasks_import_down_and_not_across():
    """rewards and tools stand on the package's own modules (the task interface, data, the
    user's code) and not on each other; the ecosystems' adapters and the built-in tasks use
    them; nothing below imports those two, nor the package's __init__ (the task registry)."""
    assert _task_room("grouprl.tasks.rewards.math") == "rewards"
    assert _task_room("grouprl.tasks.base") == "" and _task_room("grouprl.tasks") is None
    for module, imported in _modules_under("grouprl.tasks").items():
        room = _task_room(module)
        if room is None or module.endswith("__init__") or module in PACKAGES:
            continue
        floor = TASK_ROOMS.get(room, 0)
        for target in imported:
            assert target != "grouprl.tasks", f"{module} imports the task registry"
            other = _task_room(target)
            if other is None or other == room:
                continue
            other_floor = TASK_ROOMS.get(other, 0)
            assert other_floor < floor, f"{module} ({room or 'tasks'}) imports {target}"
