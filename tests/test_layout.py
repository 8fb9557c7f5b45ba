"""The layout is the architecture: klpipe/model/ is the only package that may import torch.

Every other module is imported in a fresh interpreter where torch, transformers and datasets
cannot be imported at all, so a stray module-level import fails here, not on a scoring host.
"""

import ast
import pkgutil
from pathlib import Path

import klpipe
from tests.helpers import block_imports, run_python

BLOCKED = ("torch", "transformers", "datasets")

# Imports every module named on the command line, where torch, transformers and datasets cannot be.
BLOCK_AND_IMPORT = block_imports(*BLOCKED) + """
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
"""


def all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(klpipe.__path__, prefix="klpipe."))


def test_every_module_outside_model_imports_without_torch():
    # __main__ runs the CLI when imported; it imports nothing of its own beyond klpipe.cli.
    outside = [name for name in all_modules() if not name.startswith("klpipe.model") and name != "klpipe.__main__"]
    assert "klpipe.precompute.run" in outside and "klpipe.score.run" in outside and "klpipe.cli.precompute" in outside
    result = run_python(BLOCK_AND_IMPORT, *outside)
    assert result.returncode == 0, result.stderr


def test_the_model_package_is_where_torch_is_imported():
    # The boundary is real: model/ does need torch, so the check above is not vacuous.
    result = run_python(BLOCK_AND_IMPORT, "klpipe.model")
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


def test_no_module_outside_model_imports_torch_even_inside_a_function():
    # A function-level `import torch` passes the test above and still breaks the boundary: the stage's
    # torch needs (defaults, versions) go through klpipe.model. `datasets` is a reader's, not the model's.
    offenders = []
    for path in sorted(Path(klpipe.__file__).parent.rglob("*.py")):
        if "model" in path.relative_to(Path(klpipe.__file__).parent).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(Path(klpipe.__file__).parent)}:{node.lineno} imports {name}"
                          for name in names if name.split(".")[0] in ("torch", "transformers")]
    assert not offenders, offenders


def imports_within(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package at `package_dir` it imports, at module level or inside a
    function (a lazy import still ties the two together), outside `if TYPE_CHECKING:`. `from package
    import module` counts as the module; a package importing its own submodules (its interface, eager
    or through a lazy `__getattr__`) is no tie."""
    top = package_dir.name
    graph = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(), str(path))
        hidden = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                  and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(block)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == top}
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == top:
                for alias in node.names:
                    module = Path(package_dir.parent, *f"{node.module}.{alias.name}".split("."))
                    is_module = module.with_suffix(".py").exists() or (module / "__init__.py").exists()
                    deps.add(f"{node.module}.{alias.name}" if is_module else node.module)
        if path.name == "__init__.py":
            deps = {d for d in deps if not d.startswith(name + ".")}
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep in graph and dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    return next((c for node in sorted(graph) if node not in state and (c := visit(node))), None)


def test_klpipe_modules_import_each_other_without_cycles():
    graph = imports_within(Path(klpipe.__file__).parent)
    assert "klpipe.storage.store" in graph["klpipe.storage.fingerprint"]  # the graph is read, not empty
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_check_sees_a_lazy_import(tmp_path):
    # As store.py once imported fingerprint.py inside a function while fingerprint.py imported store.py.
    files = tmp_path / "pkg" / "files"
    files.mkdir(parents=True)
    for init in (tmp_path / "pkg", files):
        (init / "__init__.py").write_text("")
    (files / "store.py").write_text("def local_copy():\n    from pkg.files.fingerprint import cache_dir\n")
    (files / "fingerprint.py").write_text("from pkg.files.store import local_copy\n")
    graph = imports_within(tmp_path / "pkg")
    assert find_cycle(graph) == ["pkg.files.fingerprint", "pkg.files.store", "pkg.files.fingerprint"]
    (files / "store.py").write_text("if TYPE_CHECKING:\n    from pkg.files import fingerprint\n")
    assert find_cycle(imports_within(tmp_path / "pkg")) is None


def test_an_error_module_sits_below_what_raises_it():
    """store_errors.py builds the errors store.py raises: it imports nothing of store.py, not even for types."""
    path = Path(klpipe.__file__).parent / "storage" / "store_errors.py"
    named = {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
    assert "klpipe.errors" in named  # the imports are read, not empty
    assert not {m for m in named if m and m.startswith("klpipe.storage")}, named


def test_the_plan_sits_below_planning_and_running():
    # precompute/ plans and model/ runs: the plan (Tree, Pass, Wanted) is their contract, in klpipe/plan.py,
    # which imports neither; model/ reads nothing of precompute/, even lazily.
    graph = imports_within(Path(klpipe.__file__).parent)
    assert "klpipe.plan" in graph["klpipe.model.attention.tree"]
    assert "klpipe.plan" in graph["klpipe.precompute.prefix_tree"]
    assert graph["klpipe.plan"] == set()
    upward = sorted(f"{module} imports {dep}" for module, deps in graph.items() if module.startswith("klpipe.model")
                    for dep in deps if dep.startswith("klpipe.precompute"))
    assert not upward, upward


def test_the_tests_mirror_the_packages():
    # tests/<package>/ holds a package's tests; the top level only the shared modules' (test_columns for
    # klpipe/columns.py) and the whole project's (docs, layout, install, memory, faults, examples, flops).
    source, tests = Path(klpipe.__file__).parent, Path(__file__).parent
    packages = {path.parent.name for path in source.glob("*/__init__.py")}
    assert {"cli", "model", "precompute", "score", "inspect", "storage", "atropos"} <= packages
    for package in packages:
        assert list((tests / package).glob("test_*.py")), f"tests/{package}/ holds no tests of klpipe/{package}/"
    in_packages = {path.stem for path in source.glob("*/**/*.py")} - {path.stem for path in source.glob("*.py")}
    misplaced = sorted(path.name for path in tests.glob("test_*.py") if path.stem.removeprefix("test_") in in_packages)
    assert not misplaced, f"tests of a package's module belong in its folder: {misplaced}"
