"""Package boundaries: `scheduler` imports neither torch nor `alisa`; `quant` no `alisa`."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("scheduler", {"torch", "alisa", "transformers"}), ("quant", {"alisa"})],
)
def test_leaf_packages_stay_leaves(package, forbidden):
    assert (ROOT / package / "__init__.py").is_file()
    assert not imported_modules(package) & forbidden


@pytest.mark.parametrize("package", ["alisa", "scheduler", "quant", "experiments"])
def test_required_packages_are_importable(package):
    __import__(package)
