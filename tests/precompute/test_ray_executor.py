"""`precompute --ray` without a cluster: what the driver refuses before it starts anything, and that klpipe
never imports Ray unless asked. The runs on a real Ray cluster are in tests/ray (`make test-ray`)."""

from __future__ import annotations

import copy
import gzip
from pathlib import Path

import pytest
from typer.testing import CliRunner

from klpipe.cli import app
from klpipe.errors import InputError
from klpipe.precompute.ray_cluster import INSTALL
from klpipe.precompute.ray_executor import RayConfig
from tests.helpers import ROLLOUTS, RUN_KLPIPE, TINY_GEMMA, block_imports, run_python

runner = CliRunner()


def test_without_ray_installed_the_option_names_the_install_command(tmp_path):
    # Ray is made unimportable, as where the extra is not installed; nothing is written.
    code = block_imports("ray") + RUN_KLPIPE
    result = run_python(code, "precompute", "-m", str(TINY_GEMMA), str(ROLLOUTS), "-o", str(tmp_path / "out"),
                        "--ray", "local")
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"Error: --ray needs Ray, which klpipe installs only on request: {INSTALL}\n"
    assert INSTALL == 'pip install "klpipe[ray]"'
    assert not (tmp_path / "out").exists()


def test_klpipe_imports_no_ray_without_the_option():
    code = ("import sys\nimport klpipe.cli, klpipe.cli.precompute, klpipe.precompute.ray_executor\n"
            "from klpipe.precompute import run\nprint('ray' in sys.modules)")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_shard_of_its_own_is_refused_with_ray(tmp_path):
    result = runner.invoke(app, ["precompute", "-m", str(TINY_GEMMA), str(ROLLOUTS), "-o", str(tmp_path / "out"),
                                 "--ray", "local", "--shard-index", "0", "--num-shards", "2"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "Error: --shard-index is for one process's shard; with --ray the driver runs every shard")


@pytest.mark.parametrize("options, message", [
    ({"address": ""}, "--ray needs an address: auto, local, or HOST:PORT of the cluster's head"),
    ({"num_shards": 0}, "--num-shards must be at least 1"),
    ({"gpus_per_shard": -1}, "--ray-gpus-per-shard must not be negative"),
    ({"cpus_per_shard": 0}, "--ray-cpus-per-shard must be positive"),
    ({"max_retries": -1}, "--ray-max-retries must not be negative"),
])
def test_ray_options_are_checked(options, message):
    with pytest.raises(InputError) as raised:
        RayConfig(**{"address": "auto", **options})
    assert str(raised.value) == message


def test_the_rayjob_example_uses_only_options_klpipe_has():
    import shlex

    import typer.main
    import yaml

    from tests.helpers import ROOT

    job = yaml.safe_load((ROOT / "examples" / "rayjob.yaml").read_text())
    commands = typer.main.get_command(app).commands
    used = {}
    for part in job["spec"]["entrypoint"].split("&&"):
        words = shlex.split(part)
        assert words[0] == "klpipe", part
        used[words[1]] = [w for w in words[2:] if w.startswith("--")]
    assert set(used) == {"precompute", "score"}
    for command, options in used.items():
        known = {opt for param in commands[command].params for opt in param.opts}
        assert set(options) <= known, f"{command}: {set(options) - known}"
    assert "--ray" in used["precompute"]
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == "1"


KUBERAY_VERSION = "v1.7.0"  # tests/data/kuberay/README.md: where the CRD comes from
RAYJOB_CRD = Path(__file__).parents[1] / "data" / "kuberay" / "ray.io_rayjobs.yaml.gz"


@pytest.fixture(scope="module")
def rayjob_schema() -> dict:
    """The openAPIV3Schema of KubeRay's RayJob CRD, version v1: what the API server checks a RayJob against."""
    import yaml

    with gzip.open(RAYJOB_CRD, "rt") as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayJob" and crd["spec"]["group"] == "ray.io"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def schema_errors(document: dict, schema: dict) -> list[str]:
    """What the API server would refuse in `document`: the schema's types, enums, patterns and required fields
    (jsonschema; OpenAPI's own keywords, x-kubernetes-*, are annotations to it), and, as `kubectl apply
    --validate=strict` does, every field the schema does not declare (a misspelt field is otherwise dropped
    without a word)."""
    import jsonschema

    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft4Validator(schema).iter_errors(document)]

    def unknown(value, node: dict, path: str) -> None:
        if isinstance(value, dict) and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            for key, item in value.items():
                if key not in node["properties"]:
                    errors.append(f"{path}.{key}: unknown field")
                else:
                    unknown(item, node["properties"][key], f"{path}.{key}")
        elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
            for key, item in value.items():
                unknown(item, node["additionalProperties"], f"{path}.{key}")
        elif isinstance(value, list) and "items" in node:
            for i, item in enumerate(value):
                unknown(item, node["items"], f"{path}[{i}]")

    unknown(document, schema, "")
    return errors


def test_the_rayjob_example_is_a_rayjob_kuberay_accepts(rayjob_schema):
    import yaml

    from tests.helpers import ROOT

    job = yaml.safe_load((ROOT / "examples" / "rayjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert schema_errors(job, rayjob_schema) == []
    assert "openAPIV3Schema" not in job and KUBERAY_VERSION in RAYJOB_CRD.with_name("README.md").read_text()

    # The check can fail: a wrong type, a required field missing, a misspelt field.
    bad = copy.deepcopy(job)
    bad["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "4"
    del bad["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["name"]
    bad["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {}
    errors = schema_errors(bad, rayjob_schema)
    assert any(e.startswith("spec.rayClusterSpec.workerGroupSpecs.0.replicas: '4' is not of type") for e in errors)
    assert "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0: 'name' is a required property" in errors
    assert ".spec.rayClusterSpec.headGroupSpec.rayStartParam: unknown field" in errors, errors


def test_a_task_runs_in_the_drivers_directory_and_goes_back(tmp_path, monkeypatch):
    """ray_task.in_directory, as a Ray worker runs a shard: in the driver's directory within, its own after (Ray runs
    the worker's next task in the same process)."""
    from klpipe.precompute.config import PrecomputeConfig
    from klpipe.precompute.ray_task import in_directory

    worker, driver = tmp_path / "worker", tmp_path / "driver"
    worker.mkdir()
    driver.mkdir()
    monkeypatch.chdir(worker)
    config = PrecomputeConfig(inputs=[Path("rollouts.parquet")], model="hub/model", output=Path("cached"))
    with in_directory(str(driver), config, "node"):
        assert Path.cwd() == driver
    assert Path.cwd() == worker


def test_a_node_without_the_drivers_directory_refuses_relative_paths_in_one_line(tmp_path, monkeypatch):
    from klpipe.precompute.config import PrecomputeConfig
    from klpipe.precompute.ray_task import in_directory

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ref").mkdir()  # a model given as a relative directory counts; a hub id (no such directory) not
    relative = PrecomputeConfig(inputs=[Path("rollouts.parquet"), ROLLOUTS], model="ref", output=Path("cached"))
    gone = str(tmp_path / "driver")
    with pytest.raises(InputError) as raised, in_directory(gone, relative, "10.0.0.11 (4c45512a)"):
        pass
    assert str(raised.value) == (f"rollouts.parquet, cached, ref: relative to the driver's directory {gone}, which "
                                 "node 10.0.0.11 (4c45512a) does not have; give absolute paths on storage every node "
                                 "sees")
    absolute = PrecomputeConfig(inputs=[ROLLOUTS], model="hub/model", output=tmp_path / "cached")
    with in_directory(gone, absolute, "node"):  # nothing relative: runs where it is
        assert Path.cwd() == tmp_path
