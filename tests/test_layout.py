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
        if path.parent.name == "model":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{path.relative_to(Path(klpipe.__file__).parent)}:{node.lineno} imports {name}"
                          for name in names if name.split(".")[0] in ("torch", "transformers")]
    assert not offenders, offenders

