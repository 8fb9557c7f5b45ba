"""The contract between precompute/ and the model (klpipe/contract.py), held by reading the source: only klpipe/model/
changes a model, and precompute/ reads a model only through the ScoringModel Protocol. (That the ReferenceModel has
every member is tests/model/test_reference.py's, on a loaded model; mypy holds the members' types.)"""

import ast
from pathlib import Path

import klpipe
from klpipe.contract import ScoringModel

SOURCE = Path(klpipe.__file__).parent
MODEL_NAMES = {"model", "policy", "reference", "ref", "own"}  # what a model is called outside model/
PROTOCOL = "ScoringModel"
MEMBERS = {name for name in dir(ScoringModel) if not name.startswith("_")}


def _annotated(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The parameters of `function` annotated with the Protocol (alone, or `| None`)."""
    arguments = function.args
    return {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            if a.annotation is not None and PROTOCOL in ast.unparse(a.annotation)}


def _is_model(node: ast.expr, models: set[str]) -> bool:
    """A name that is a model (`model`, or a Protocol-annotated parameter), or `self.model` and the like."""
    if isinstance(node, ast.Name):
        return node.id in models
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and node.attr in MODEL_NAMES)


def model_writes(source: str, name: str = "<source>") -> list[str]:
    """`file:line writes model.attribute` for each assignment to (or setattr of) an attribute of a model in `source`."""
    tree = ast.parse(source, name)
    found = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] + [tree]
    for scope in scopes:
        models = MODEL_NAMES | (_annotated(scope) if not isinstance(scope, ast.Module) else set())
        for node in ast.walk(scope):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            flat = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            for target in flat:
                if isinstance(target, ast.Attribute) and _is_model(target.value, models):
                    found.append(f"{name}:{node.lineno} writes {ast.unparse(target)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and _is_model(node.args[0], models)):
                found.append(f"{name}:{node.lineno} writes {ast.unparse(node.args[0])} by setattr")
    return sorted(set(found))


def protocol_reads(source: str, name: str = "<source>") -> list[str]:
    """`file:line reads param.attribute` for each read of a Protocol-annotated parameter's attribute that is not a
    member of the Protocol, and each getattr of a model."""
    tree = ast.parse(source, name)
    found = []
    for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        typed = _annotated(function)
        for node in ast.walk(function):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in typed
                    and node.attr not in MEMBERS):
                found.append(f"{name}:{node.lineno} reads {ast.unparse(node)}, not a member of {PROTOCOL}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and node.args and _is_model(node.args[0], MODEL_NAMES | typed)):
                found.append(f"{name}:{node.lineno} reads {ast.unparse(node)}: a member is read plainly")
    return sorted(set(found))


def _outside_model() -> list[Path]:
    return [path for path in sorted(SOURCE.rglob("*.py")) if path.relative_to(SOURCE).parts[0] != "model"]


def test_no_module_outside_model_writes_an_attribute_of_a_model():
    # A model's state is decided in klpipe/model/ (its loader, its checks, its named methods), never set from afar.
    offenders = [line for path in _outside_model()
                 for line in model_writes(path.read_text(), str(path.relative_to(SOURCE)))]
    assert not offenders, offenders


def test_the_write_check_sees_a_write():
    # As precompute/run.py once set the streaming budget on the models it had loaded.
    assert model_writes("def f(model, policy):\n    model.stream_tokens = 3\n    policy.stream_cache_mib += 1\n") == [
        "<source>:2 writes model.stream_tokens", "<source>:3 writes policy.stream_cache_mib"]
    assert model_writes("def f(m: ScoringModel):\n    m.packed, x = False, 1\n    setattr(m, 'cascade', 0)\n") == [
        "<source>:2 writes m.packed", "<source>:3 writes m by setattr"]
    assert model_writes("class S:\n    def f(self):\n        self.model.cascade = False\n") == [
        "<source>:3 writes self.model.cascade"]
    assert model_writes("def f(model):\n    model = 3\n    plan.packed = model.packed\n") == []


def test_precompute_reads_a_model_only_through_the_protocol():
    # Every parameter annotated with the Protocol reads only its members, and no model is read by getattr.
    paths = sorted((SOURCE / "precompute").rglob("*.py"))
    typed = [path for path in paths if PROTOCOL in path.read_text()]
    assert {"logprobs.py", "sharing.py", "scorer.py", "run.py"} <= {path.name for path in typed}  # read, not empty
    offenders = [line for path in paths for line in protocol_reads(path.read_text(), str(path.relative_to(SOURCE)))]
    assert not offenders, offenders


def test_the_read_check_sees_a_read_outside_the_protocol():
    source = ("def f(model: ScoringModel, other):\n    model.packed\n    model.body\n"
              "    getattr(model, 'streamer', None)\n    other.body\n")
    assert protocol_reads(source) == [
        "<source>:3 reads model.body, not a member of ScoringModel",
        "<source>:4 reads getattr(model, 'streamer', None): a member is read plainly"]
    assert "packed" in MEMBERS and "streamer" in MEMBERS and "body" not in MEMBERS
