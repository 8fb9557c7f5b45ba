"""Tensors read from safetensors files by positioned reads (klpipe/model/tensor_files.py), held to safetensors' own
reader, and a damaged file refused in one line before any tensor of it is used."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from klpipe.errors import ModelError
from klpipe.model.tensor_files import TensorFiles


def test_every_dtype_reads_as_safetensors_reads_it(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=generator), "bf16": torch.randn(7, generator=generator).bfloat16(),
               "f16": torch.randn(2, 2, 2, generator=generator).half(),
               "f64": torch.randn(4, generator=generator).double(),
               "i64": torch.arange(6).reshape(2, 3), "bool": torch.tensor([True, False, True]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "pt"})
    save_file({"other": torch.ones(2)}, tmp_path / "b.safetensors")
    files = TensorFiles([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    try:
        expected = {**load_file(tmp_path / "a.safetensors"), **load_file(tmp_path / "b.safetensors")}
        assert sorted(files.entries) == sorted(expected)
        for name, tensor in expected.items():
            got = files.read(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
    finally:
        files.close()


def damaged(path, change) -> None:
    """`path` rewritten with its header changed by `change` (a function of the parsed header)."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = change(json.loads(data[8:8 + length]))
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


@pytest.mark.parametrize("change, words", [
    (lambda h: {**h, "w": {**h["w"], "data_offsets": [0, 10**9]}}, "lie outside the file"),
    (lambda h: {**h, "w": {**h["w"], "shape": [3, 3]}}, "do not match its shape"),
    (lambda h: {**h, "w": {**h["w"], "dtype": "F4"}}, "dtype, shape or range klpipe cannot read"),
])
def test_a_damaged_header_is_refused_in_one_line(tmp_path, change, words):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2, 3)}, path)
    damaged(path, change)
    with pytest.raises(ModelError, match=words):
        TensorFiles([path])


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x80\x04\x95pickle, not safetensors")
    with pytest.raises(ModelError, match="not a safetensors file"):
        TensorFiles([path])


def test_a_file_cut_short_is_refused_before_a_read(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64)}, path)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ModelError, match="lie outside the file"):
        TensorFiles([path])
