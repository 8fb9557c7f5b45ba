"""Sizes a reader can hold in mind: a module of one job within 400 lines, a function within 80 lines and 8 parameters
(`self`/`cls` not counted). Loose parameter lists fold into the record they describe (a chunk run, a tree pass, the
joint head's settings). The few that stay are named below, each with why; an entry that no longer needs its place
fails too, so the list cannot go stale."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "klpipe"
MODULE_LINES, FUNCTION_LINES, PARAMETERS = 400, 80, 8

# "module.path:qualified.name" -> why it keeps more than PARAMETERS parameters.
MANY_PARAMETERS = {
    "klpipe.model.attention.context_cache:ContextCache.__init__":
        "a pass's rows as the tree lays them out (context, ancestors, cached, in place, real slots, segments) beside "
        "the layer kinds and the tree: its two callers in attention/tree.py pass each by name",
    "klpipe.precompute.logprobs:chunk_logprobs":
        "the library's one-call entry for a chunk (tests and benchmarks call it with keyword options); the run "
        "itself goes through ChunkScorer",
}
# "module.path:qualified.name" -> why it is longer than FUNCTION_LINES.
LONG_FUNCTIONS: dict[str, str] = {}
# "module/path.py" -> why it is longer than MODULE_LINES.
LONG_MODULES: dict[str, str] = {}


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module by its qualified name (Class.method, outer.inner)."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((prefix + node.name, node))
            found += _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            found += _functions(node, f"{prefix}{node.name}.")
        elif not isinstance(node, ast.expr):
            found += _functions(node, prefix)
    return found


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def measure() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(function -> parameters over the limit, function -> lines over the limit, module -> lines over the limit)."""
    many, long, modules = {}, {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        relative = path.relative_to(ROOT).as_posix()
        if len(source.splitlines()) > MODULE_LINES:
            modules[relative] = len(source.splitlines())
        module = relative.removesuffix(".py").replace("/", ".")
        for name, node in _functions(ast.parse(source)):
            key = f"{module}:{name}"
            if parameters(node) > PARAMETERS:
                many[key] = parameters(node)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > FUNCTION_LINES:
                long[key] = lines
    return many, long, modules


def test_no_function_takes_more_parameters_than_a_reader_holds_but_those_named():
    many, _, _ = measure()
    assert sorted(set(many) - set(MANY_PARAMETERS)) == [], {k: many[k] for k in set(many) - set(MANY_PARAMETERS)}
    assert sorted(set(MANY_PARAMETERS) - set(many)) == [], "within the limit now: drop them from MANY_PARAMETERS"


def test_no_function_is_longer_than_a_screen_but_those_named():
    _, long, _ = measure()
    assert sorted(set(long) - set(LONG_FUNCTIONS)) == [], {k: long[k] for k in set(long) - set(LONG_FUNCTIONS)}
    assert sorted(set(LONG_FUNCTIONS) - set(long)) == [], "within the limit now: drop them from LONG_FUNCTIONS"


def test_no_module_is_longer_than_one_job_but_those_named():
    _, _, modules = measure()
    assert sorted(set(modules) - set(LONG_MODULES)) == [], modules
    assert sorted(set(LONG_MODULES) - set(modules)) == [], "within the limit now: drop them from LONG_MODULES"


def test_the_measure_counts_what_it_says():
    source = ("class A:\n    def m(self, a, b, *c, d, **e):\n        def inner(x):\n            pass\n"
              "def f(a, b, c, d, e, f, g, h, i):\n" + "    x = 1\n" * 85)
    found = dict(_functions(ast.parse(source)))
    assert sorted(found) == ["A.m", "A.m.inner", "f"]
    assert parameters(found["A.m"]) == 5 and parameters(found["A.m.inner"]) == 1 and parameters(found["f"]) == 9
    assert found["f"].end_lineno - found["f"].lineno + 1 == 86
