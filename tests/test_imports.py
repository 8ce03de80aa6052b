"""No import circles: every import counts, late imports inside functions and TYPE_CHECKING ones too.

A module graph over alisa/, scheduler/, quant/ and experiments/ is read with ``ast`` (nothing is
imported); a strongly connected component of more than one module is a circle.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("alisa", "scheduler", "quant", "experiments", "probes")


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = package[: len(package) - node.level + 1]
                    base = ".".join([*prefix, *([node.module] if node.module else [])])
                for alias in node.names:
                    targets.add(known(f"{base}.{alias.name}") or known(base))
        # Importing a.b.c runs a/__init__ and a/b/__init__ too (outside their own package).
        for target in list(targets):
            parts = (target or "").split(".")
            for cut in range(1, len(parts)):
                parent = ".".join(parts[:cut])
                if parent in modules and not name.startswith(parent + "."):
                    targets.add(parent)
        targets.discard(None)
        targets.discard(name)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                    found.append(sorted(component))
    return found


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    found = circles(import_graph(module_files()))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("module", ["alisa.config", "alisa.cli"])
def test_graph_sees_late_imports(module):
    # Guards the checker itself: both modules have imports inside functions or type checks.
    assert import_graph(module_files())[module]


# The package's floors, lowest first, as docs/architecture.md draws them: a module imports only
# from its own floor or below, so the floors read bottom-up are the architecture.
FLOORS = (
    ("leaves", ("quant", "scheduler")),
    ("kernels", ("alisa.ops",)),
    (
        "basics",
        (
            "alisa.checks",
            "alisa.memory",
            "alisa.sizes",
            "alisa.jsonl",
            "alisa.logs",
            "alisa.assignments",
            "alisa.threads",
        ),
    ),
    ("settings", ("alisa.policies", "alisa.settings", "alisa.config")),
    ("model", ("alisa.model",)),
    ("storage", ("alisa.storage",)),
    ("planning", ("alisa.planning",)),
    ("kv cache", ("alisa.kv",)),
    ("runtime", ("alisa.runtime",)),
    ("scale-out", ("alisa.parallel",)),
    ("front ends", ("alisa.jobs", "alisa.calibration", "alisa.record", "alisa.serve")),
    ("public API", ("alisa",)),
    ("experiments", ("experiments",)),
    ("probes", ("probes",)),  # one-off measurements, not installed
    ("CLI", ("alisa.commands", "alisa.cli", "alisa.__main__")),
)


def floor_of(module: str) -> int:
    """Index in FLOORS of the longest unit (package or module) containing ``module``."""
    best, level = "", None
    for index, (_, units) in enumerate(FLOORS):
        for unit in units:
            inside = module == unit or module.startswith(unit + ".")
            if inside and len(unit) > len(best):
                best, level = unit, index
    if level is None:
        raise KeyError(f"{module} is on no floor: add it to FLOORS and docs/architecture.md")
    return level


def test_every_module_imports_only_from_its_floor_or_below():
    graph = import_graph(module_files())
    upward = sorted(
        f"{source} ({FLOORS[floor_of(source)][0]}) -> {target} ({FLOORS[floor_of(target)][0]})"
        for source, targets in graph.items()
        for target in targets
        if floor_of(target) > floor_of(source)
    )
    assert not upward, "imports from a higher floor: " + "; ".join(upward)


def test_the_floor_checker_places_modules_by_their_longest_unit():
    assert FLOORS[floor_of("alisa.kv.layer")][0] == "kv cache"
    assert FLOORS[floor_of("alisa")][0] == "public API"
    assert FLOORS[floor_of("alisa.cli")][0] == "CLI"
    with pytest.raises(KeyError, match="no floor"):
        floor_of("alisa_elsewhere")
