"""Finding inputs and naming outputs: directories expanded, default output names, outputs kept off inputs."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from klpipe.errors import InputError, OutputError

PARQUET_SUFFIXES = (".parquet",)

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")


def is_datasets_dir(path: Path) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk`."""
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def expand_inputs(paths: list[str | Path], suffixes: tuple[str, ...]) -> list[Path]:
    """Files named on the command line, with directories expanded to their files in sorted order.

    A `save_to_disk` directory stays whole: `datasets` reads it as one input.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise InputError(f"{path}: no such file or directory")
        if path.is_dir() and not is_datasets_dir(path):
            children = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(suffixes))
            if not children:
                raise InputError(f"{path}: directory holds no {'/'.join(suffixes)} files")
            found.extend(children)
        else:
            found.append(path)
    return found


def output_beside(first_input: str | Path, suffix: str, input_suffixes: tuple[str, ...]) -> Path:
    """`<stem><suffix>` beside the first input, the stem being its name less an input suffix (a directory's
    whole name): `day.v1.parquet` → `day.v1<suffix>`, so inputs that differ before the suffix never share an output."""
    first_input = Path(first_input)
    name = first_input.name
    if not first_input.is_dir():
        known = [s for s in input_suffixes if name.endswith(s)]
        name = name.removesuffix(max(known, key=len)) if known else name
    return first_input.parent / f"{name}{suffix}"


def refuse_overwriting_inputs(output: Path, inputs: list[Path]) -> None:
    """An output that is also an input would destroy the input: both stages refuse it, --overwrite or not."""
    resolved = Path(output).resolve()
    for path in inputs:
        if Path(path).resolve() == resolved:
            raise OutputError(f"{output}: is also an input; pass another --output")


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
