"""What each host installs: `pip install klpipe` for scoring (no torch), `klpipe[precompute]` for stage 1.

The bare package goes into a fresh virtual environment from the package index, as on a cron box,
and must score a cache there; `klpipe precompute` must say which command adds what it lacks.
"""

import re
import shutil
import subprocess
import sys

import pytest

from klpipe.errors import ModelError
from klpipe.model.loading import TRANSFORMERS_SUPPORTED, check_transformers_version
from tests.helpers import ROOT, make_rows, write_cache


def project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the rest of this file runs on 3.10 too
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement(extra: str | None, name: str) -> str:
    requirements = project()["dependencies"] if extra is None else project()["optional-dependencies"][extra]
    return next(r for r in requirements if re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0] == name)


def test_the_light_half_is_all_that_klpipe_score_installs():
    names = {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0] for r in project()["dependencies"]}
    assert names == {"numpy", "pyarrow", "typer", "rich"}
    assert requirement("precompute", "transformers") == "transformers" + ",".join(TRANSFORMERS_SUPPORTED)
    # The floors that klpipe's own code needs: Literal options (typer 0.19), page checksums (pyarrow 15).
    assert requirement(None, "typer") == "typer>=0.19" and requirement(None, "pyarrow") == "pyarrow>=15"


def test_a_transformers_outside_the_tested_range_is_refused():
    check_transformers_version("5.24.0")
    check_transformers_version("5.99.1")
    for version in ("5.23.0", "6.0.0", "4.57.1"):
        with pytest.raises(ModelError, match=f"tested with transformers >=5.24,<6 and found {version}; "
                                             "pip install 'transformers>=5.24,<6'"):
            check_transformers_version(version)


@pytest.mark.slow
def test_the_bare_package_scores_in_a_fresh_environment_without_torch(tmp_path):
    source = tmp_path / "src"  # what a source distribution holds: no tests, no venv, nothing built
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "klpipe", source / "klpipe", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", str(source)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr
    for heavy in ("torch", "transformers", "datasets"):
        probe = subprocess.run([str(python), "-c", f"import {heavy}"], capture_output=True, text=True)
        assert probe.returncode != 0, f"{heavy} came with the bare package"

    cache = write_cache(tmp_path / "cached.parquet", make_rows(40))
    klpipe = venv / "bin" / "klpipe"
    scored = subprocess.run([str(klpipe), "score", str(cache), "-o", str(tmp_path / "scored.parquet")],
                            capture_output=True, text=True, timeout=120)
    assert scored.returncode == 0, scored.stderr
    assert (tmp_path / "scored.parquet").exists()
    inspect = subprocess.run([str(klpipe), "inspect", str(cache), "-o", str(tmp_path / "kl.html")],
                             capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 2 and not (tmp_path / "kl.html").exists()
    assert inspect.stderr == ("Error: klpipe inspect decodes tokens with the tokenizers library: "
                              "pip install 'klpipe[inspect]'\n")
    precompute = subprocess.run([str(klpipe), "precompute", "-m", "some/model", str(cache)],
                                capture_output=True, text=True, timeout=120)
    assert precompute.returncode == 2
    assert precompute.stderr == ("Error: klpipe precompute needs torch and transformers, which klpipe score does "
                                 "not: pip install 'klpipe[precompute]' (on a GPU machine, your CUDA build of "
                                 "torch first)\n")
