"""docs/development.md's map names every module under klpipe/ once, in its folder, and none that is gone.

The map is the code block under "## Layout": a line whose first word is `name/` opens a folder at its indent, a
line whose first word is `name.py` names a module of the folder it is indented under, and a deeper line carries
on the one above. A module added, moved or renamed fails here until the map says where it went.
"""

import ast
import re
from collections import Counter

from tests.helpers import ROOT

KLPIPE = ROOT / "klpipe"
ENTRY = re.compile(r"^( *)([\w.]+/|\w+\.py)(?:\s|$)")


def mapped_modules() -> list[str]:
    """Every module the map names, as a path under klpipe/ (`model/attention/tree.py`), in the map's order."""
    layout = (ROOT / "docs" / "development.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = layout.split("```\n", 2)[1]
    lines = block.splitlines()
    assert lines[0] == "klpipe/", "the map's code block starts at klpipe/"
    folders: list[str] = []
    modules = []
    for line in lines[1:]:
        if line and not line.startswith(" "):
            break  # the next top-level folder (benchmarks/, ...): the map of klpipe/ ends
        match = ENTRY.match(line)
        if not match or len(match[1]) % 2 or len(match[1]) // 2 > len(folders) + 1:
            continue  # a description carried onto the next line
        depth = len(match[1]) // 2 - 1
        folders = folders[:depth]
        if match[2].endswith("/"):
            folders.append(match[2])
        else:
            modules.append("".join(folders) + match[2])
    return modules


def source_modules() -> set[str]:
    return {path.relative_to(KLPIPE).as_posix() for path in KLPIPE.rglob("*.py") if path.name != "__init__.py"}


def test_the_map_reads_its_folders():
    # The parser itself: a nested module, a package's and a top-level one after a package.
    modules = mapped_modules()
    assert "model/attention/tree.py" in modules and "score/run.py" in modules and "__main__.py" in modules


def test_every_module_is_on_the_map_once():
    modules = mapped_modules()
    twice = sorted(name for name, count in Counter(modules).items() if count > 1)
    missing = sorted(source_modules() - set(modules))
    assert not twice, f"docs/development.md's map names these more than once: {twice}"
    assert not missing, f"docs/development.md's map lacks these modules of klpipe/: {missing}"


def test_the_map_names_no_module_that_is_gone():
    gone = sorted(set(mapped_modules()) - source_modules())
    assert not gone, f"docs/development.md's map names modules klpipe/ does not hold: {gone}"


def test_package_docstrings_leave_the_modules_to_the_map():
    # A package's docstring says what the package does; a list of its modules there went stale before.
    listing = re.compile(r"^\w+(\.py|/)\s{2,}", re.MULTILINE)
    offenders = [path.relative_to(ROOT).as_posix() for path in sorted(KLPIPE.rglob("__init__.py"))
                 if listing.search(ast.get_docstring(ast.parse(path.read_text())) or "")]
    assert not offenders, f"these package docstrings list modules (docs/development.md maps them): {offenders}"
