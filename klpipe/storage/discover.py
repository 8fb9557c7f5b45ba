"""Finding inputs and naming outputs: directories expanded, default output names, outputs kept off inputs.

Every function here takes local paths and locations on a store alike (storage/store.py): a prefix
on a store is a directory, and a URI pattern (`s3://bucket/day-*/*.parquet`) names its matches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa

from klpipe.errors import InputError, OutputError
from klpipe.storage.store import Location, expand, identity, is_remote, location
from klpipe.storage.store_errors import missing

PARQUET_SUFFIXES = (".parquet",)

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def is_datasets_dir(path: Location) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk`."""
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def expand_inputs(paths: Sequence[str | Location], suffixes: tuple[str, ...],
                  skip: Callable[[Location], bool] = lambda path: False) -> tuple[list[Location], list[Location]]:
    """(files, skipped): the files named, with directories expanded to their files in sorted order.

    A `save_to_disk` directory stays whole: `datasets` reads it as one input. A file found in a
    directory for which `skip` is true (an output klpipe wrote there on an earlier run) is left out
    and listed in `skipped`, so an output written beside its inputs is never read back as an input.
    A URI pattern's matches are named files, each read as given.
    """
    found: list[Location] = []
    skipped: list[Location] = []
    for path in (path for raw in paths for path in expand(raw)):
        if not path.exists():
            if is_remote(path):
                raise missing(path)
            raise InputError(f"{path}: no such file or directory")
        if path.is_dir() and not is_datasets_dir(path):
            children = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(suffixes))
            ours = [p for p in children if skip(p)]
            children = [p for p in children if p not in ours]
            if not children:
                only = (f" but klpipe's own outputs ({', '.join(p.name for p in ours)}); name a file to read one"
                        if ours else "")
                raise InputError(f"{path}: directory holds no {'/'.join(suffixes)} files{only}")
            found.extend(children)
            skipped.extend(ours)
        else:
            found.append(path)
    return found, skipped


def output_beside(first_input: Location, suffix: str, input_suffixes: tuple[str, ...]) -> Location:
    """`<stem><suffix>` beside the first input, the stem being its name less an input suffix (a directory's
    whole name): `day.v1.parquet` → `day.v1<suffix>`, so inputs that differ before the suffix never share an output.
    Beside an input on a store, the output goes to the same store."""
    first_input = location(first_input)
    name = first_input.name
    if not first_input.is_dir():
        known = [s for s in input_suffixes if name.endswith(s)]
        name = name.removesuffix(max(known, key=len)) if known else name
    return first_input.parent / f"{name}{suffix}"


def refuse_overwriting_inputs(outputs: dict[str, Location | None], inputs: list[Location]) -> None:
    """Refuse an output that is also an input, or two outputs on one path: either would destroy a file.

    `outputs` maps each output's option (`--report`) to its path; both stages refuse, --overwrite or not.
    """
    inputs_resolved = {identity(path) for path in inputs}
    taken: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        resolved = identity(path)
        if resolved in inputs_resolved:
            raise OutputError(f"{path}: is also an input; pass another {option}")
        if resolved in taken:
            raise OutputError(f"{path}: named by both {taken[resolved]} and {option}; each output needs its own path")
        taken[resolved] = option


def schema_difference(expected: pa.Schema, got: pa.Schema) -> str:
    """How `got` differs from `expected`, for messages about inputs that must share a schema."""
    expected_fields = {f.name: f.type for f in expected}
    got_fields = {f.name: f.type for f in got}
    parts = [f"no {name}" for name in expected_fields if name not in got_fields]
    parts += [f"extra {name}" for name in got_fields if name not in expected_fields]
    parts += [
        f"{name} is {got_fields[name]} not {kind}"
        for name, kind in expected_fields.items()
        if name in got_fields and got_fields[name] != kind
    ]
    return ", ".join(parts) or "column order"
