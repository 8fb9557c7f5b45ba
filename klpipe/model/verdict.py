"""What the load-time checks decided about a model: one frozen record, made by the checks, applied in one place
(ReferenceModel.apply), and remembered between runs (storage/verdicts.py) under a key of everything that could
change it.

    own_forward        why every row runs alone, whole, by the model's own forward (probes.NOT_CAUSAL, NO_HEAD)
    head               CHUNKED: klpipe's fused head (head.LMHead); OWN: the model's own head on hidden states
    rows_alone         rows run whole one a batch: a row's logprobs move beside another's pads
    packed, padded_why rows run whole go packed (attention/packing.py), or padded and why
    compiled           --compile: the classes kept compiled (compiled.py); () every module eager; None: not asked
    cascade            the tree's attention over each row's context where it lies (cascade.py); None: not probed
    tree_probed, tree  the prefix tree's probe (precompute/logprobs.check_tree) ran, and what it found (None: exact)
    tree_passes_packed, tree_layered  how the tree's passes ran on that probe (tree.py, layered.py)
    notes              the lines the run logs about them, in order

Plain values only, no torch: it is written as JSON and read back without the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CHUNKED = "chunked"
OWN = "own"
HEADS = (CHUNKED, OWN)
NOT_CHECKED = "not checked"


@dataclass(frozen=True)
class Verdict:
    """The load-time checks' decisions about one model (see the module's docstring)."""

    own_forward: str | None = None
    head: str = CHUNKED
    rows_alone: bool = False
    packed: bool = False
    padded_why: str | None = NOT_CHECKED
    compiled: tuple[str, ...] | None = None
    cascade: bool | None = None
    tree_probed: bool = False
    tree: str | None = None
    tree_passes_packed: bool = True
    tree_layered: bool = True
    notes: tuple[str, ...] = ()

    def but(self, **changes) -> Verdict:
        """This verdict with `changes` made (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def noted(self, *lines: str) -> Verdict:
        return self.but(notes=(*self.notes, *lines))

    def to_json(self) -> dict:
        """The record as JSON values (tuples as lists)."""
        return {f.name: list(value) if isinstance(value := getattr(self, f.name), tuple) else value
                for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: object) -> Verdict:
        """The record `to_json` wrote; ValueError for anything else (a field missing, unknown or of another type)."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")  # not TypeError: the caller's one error for an unreadable entry
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"fields {sorted(set(data) ^ names)} missing or unknown")
        values = {}
        for f in dataclasses.fields(cls):
            value = data[f.name]
            if f.name in ("notes", "compiled") and isinstance(value, list):
                if not all(isinstance(item, str) for item in value):
                    raise ValueError(f"{f.name}: not a list of strings")
                value = tuple(value)
            values[f.name] = value
        verdict = cls(**values)
        verdict.validate()
        return verdict

    def validate(self) -> None:
        """ValueError where a field holds a value of another type than the record's."""
        strings = ("own_forward", "padded_why", "tree")
        flags = ("rows_alone", "packed", "tree_probed", "tree_passes_packed", "tree_layered")
        bad = [name for name in strings if not (getattr(self, name) is None or isinstance(getattr(self, name), str))]
        bad += [name for name in flags if not isinstance(getattr(self, name), bool)]
        bad += ["head"] if self.head not in HEADS else []
        bad += ["cascade"] if self.cascade not in (None, True, False) else []
        bad += ["compiled"] if not (self.compiled is None or isinstance(self.compiled, tuple)) else []
        bad += ["notes"] if not isinstance(self.notes, tuple) else []
        if bad:
            raise ValueError(f"{', '.join(bad)}: not of the record's type")
