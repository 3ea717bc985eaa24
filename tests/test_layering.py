"""Dependencies point one way (docs/architecture.md, "Layers"), read from the code's own imports:

    base (megafp8/collectives.py, collective_gemm.py, symmetric_memory.py, main_grad.py, triton_support.py,
          messages.py)
        <-  fp8  <-  parallel  <-  models  <-  training
                                           <-  planner (the layout planner's models; no trainer code uses it)
    data: independent of fp8, parallel, models, training and planner

and no module takes a private name (`_name`) of another package, by import or through a module.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package of a megafp8 module name -> where its files are
PACKAGES = {
    "fp8": ROOT / "megafp8" / "fp8",
    "training": ROOT / "megafp8" / "training",
    "planner": ROOT / "megafp8" / "planner",
    "parallel": ROOT / "parallel",
    "models": ROOT / "models",
    "data": ROOT / "data",
}
BASE_MODULES = (
    "collectives",
    "collective_gemm",
    "symmetric_memory",
    "main_grad",
    "triton_support",
    "messages",
)
FORBIDDEN = {
    "base": {"fp8", "parallel", "models", "training", "planner", "data"},
    "fp8": {"parallel", "models", "training", "planner", "data"},
    "parallel": {"models", "training", "planner", "data"},
    "models": {"training", "planner", "data"},
    "data": {"fp8", "parallel", "models", "training", "planner"},
    "training": {"planner"},
    "planner": {"training", "data"},
    "tools": set(),
    "benchmarks": set(),
    "examples": set(),
}


def _sources():
    """(layer, path) of every Python file under the rules."""
    for name in BASE_MODULES:
        yield "base", ROOT / "megafp8" / f"{name}.py"
    for layer, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            yield layer, path
    for layer in ("tools", "benchmarks", "examples"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            yield layer, path


def _package_of(module: str):
    """The layer of an absolute megafp8 module name ('megafp8.fp8.linear' -> 'fp8'), or None."""
    parts = module.split(".")
    if parts[0] != "megafp8":
        return None
    if len(parts) == 1:
        return "fp8"  # the top-level package re-exports the FP8 core
    if parts[1] in PACKAGES:
        return parts[1]
    return "base" if parts[1] in BASE_MODULES else "training"  # megafp8.train: the trainer's entry


def _imports(tree: ast.AST, path: Path):
    """(imported module, imported name or None, line) of every absolute megafp8 import; relative
    imports stay inside their own package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.module, alias.name, node.lineno


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _violations(sources, root=ROOT):
    found = []
    for layer, path in sources:
        where = path.relative_to(root)
        tree = ast.parse(path.read_text(), filename=str(path))
        modules_bound = {}  # local name -> package of the module it names
        for module, name, line in _imports(tree, path):
            package = _package_of(module)
            if package is None:
                continue
            if package != layer and package in FORBIDDEN[layer]:
                found.append(f"{where}:{line}: the {layer} layer imports {module}")
            if name is None:
                continue
            if _private(name) and package != layer:
                found.append(f"{where}:{line}: takes the private {name} of {module}")
            submodule = f"{module}.{name}"
            if _package_of(submodule) is not None:
                modules_bound[name] = _package_of(submodule)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and modules_bound.get(node.value.id, layer) != layer
            ):
                found.append(
                    f"{where}:{node.lineno}: takes the private {node.value.id}.{node.attr}"
                )
    return found


def test_dependencies_point_one_way_and_private_names_stay_home():
    assert _violations(_sources()) == []


@pytest.mark.parametrize(
    "layer, source, complaint",
    [
        ("fp8", "from megafp8.parallel.communication import all_gather", "the fp8 layer imports"),
        ("parallel", "import megafp8.models.config", "the parallel layer imports"),
        ("data", "from megafp8.fp8 import fp8_autocast", "the data layer imports"),
        ("base", "from megafp8.fp8.formats import fp8_max", "the base layer imports"),
        (
            "models",
            "from megafp8.fp8.scaling import _Observation",
            "takes the private _Observation",
        ),
        (
            "training",
            "from megafp8 import collectives\ncollectives._bytes(x)",
            "takes the private collectives._bytes",
        ),
    ],
)
def test_the_check_sees_each_kind_of_violation(tmp_path, layer, source, complaint):
    bad = tmp_path / "bad.py"
    bad.write_text(source + "\n")
    found = _violations([(layer, bad)], root=tmp_path)
    assert len(found) == 1 and complaint in found[0], found
