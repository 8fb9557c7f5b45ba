"""Tensors read from safetensors files by positioned reads (klpipe/model/tensor_files.py), held to safetensors' own
reader, and a damaged file refused in one line before any tensor of it is used; a layer read in one direct read
where its tensors lie together, and a buffer read into again only once nothing sees it."""

import json
import mmap
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from klpipe.errors import ModelError
from klpipe.model.tensor_files import Buffers, TensorFiles


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


def written(path, tensors: dict, offsets: dict | None = None) -> None:
    """A safetensors file of `tensors` (name -> tensor), laid out by hand: each at `offsets[name]` bytes into the
    data where given (gaps zero-filled), else right after the one before. safetensors' writer cannot place a tensor
    at an offset its dtype does not divide."""
    header, data = {}, bytearray()
    for name, tensor in tensors.items():
        start = (offsets or {}).get(name, len(data))
        data.extend(bytes(start - len(data)))
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        dtype = {torch.float32: "F32", torch.uint8: "U8", torch.bfloat16: "BF16"}[tensor.dtype]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [start, start + len(raw)]}
        data.extend(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # as safetensors pads it: the data starts 8-byte aligned
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data))


def direct_io_here(directory) -> bool:
    """Whether the file system under `directory` takes O_DIRECT reads (ext4 and xfs do; some tmpfs do not)."""
    probe = directory / "probe"
    probe.write_bytes(bytes(8192))
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    try:
        buffer = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT asks
        return os.preadv(fd, [buffer], 4096) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)


def test_a_layer_read_together_is_read_in_one_read_past_the_page_cache(tmp_path):
    if not direct_io_here(tmp_path):
        pytest.skip("this file system takes no O_DIRECT read, so the direct path cannot be held to anything here")
    generator = torch.Generator().manual_seed(1)
    # A layer between two others in one file, its tensors of mixed sizes, not multiples of the 4 KiB block.
    tensors = {"a.w": torch.randn(1000, generator=generator), "layer.q": torch.randn(37, 41, generator=generator),
               "layer.n": torch.randn(4, generator=generator).bfloat16(),
               "layer.up": torch.randn(300, 7, generator=generator), "z.w": torch.randn(999, generator=generator)}
    written(tmp_path / "model.safetensors", tensors)
    files, buffers = TensorFiles([tmp_path / "model.safetensors"]), Buffers()
    try:
        got = files.read_together(["layer.q", "layer.n", "layer.up"], buffers)
        assert files.direct_reads == 1
        for name, tensor in got.items():
            assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name]), name
    finally:
        files.close()


@pytest.mark.parametrize("offsets, why", [
    ({"layer.b": 3 + 4096 * 8}, "scattered: a gap of 32 KiB between the layer's two tensors"),
    ({"layer.b": 3}, "a float32 tensor at an offset 4 does not divide"),
])
def test_a_layer_the_direct_read_cannot_take_is_read_through_the_page_cache(tmp_path, offsets, why):
    tensors = {"layer.a": torch.arange(3, dtype=torch.uint8), "layer.b": torch.randn(50, 50)}
    written(tmp_path / "model.safetensors", tensors, offsets)
    files, buffers = TensorFiles([tmp_path / "model.safetensors"]), Buffers()
    try:
        got = files.read_together(["layer.a", "layer.b"], buffers)
        assert files.direct_reads == 0, why
        assert all(torch.equal(got[name], tensors[name]) for name in tensors)
        assert got["layer.b"].data_ptr() % 64 == 0  # an offset its dtype does not divide: aligned as torch aligns
    finally:
        files.close()


def test_a_gpus_staging_is_pinned_where_torch_can_pin_and_pageable_where_it_cannot(tmp_path):
    """A GPU's layer buffers are page-locked (weight_store.py); where no page-locked memory is to be had (here: no
    CUDA, as in a container over its locked-memory limit) they are pageable, and the layer reads the same."""
    tensors = {"layer.q": torch.randn(37, 41), "layer.up": torch.randn(300, 7)}
    written(tmp_path / "model.safetensors", tensors)
    files, buffers = TensorFiles([tmp_path / "model.safetensors"]), Buffers(2, pinned=True)
    try:
        got = files.read_together(list(tensors), buffers)
        for name, tensor in got.items():
            assert torch.equal(tensor, tensors[name]), name
            assert tensor.is_pinned() == torch.cuda.is_available()
        assert buffers.pinned == torch.cuda.is_available()
    finally:
        files.close()


def test_a_kept_buffer_is_never_read_into_while_anything_still_sees_it():
    buffers = Buffers(count=2)
    first, second = buffers.take(1000), buffers.take(1000)
    first.fill_(1)
    second.fill_(2)
    weight = first[100:200].view(torch.float32)  # a layer's parameter: a view of the buffer, the buffer let go
    del first
    third = buffers.take(1000)  # both kept buffers are seen: new memory, never theirs
    third.fill_(3)
    assert weight.untyped_storage().data_ptr() != third.untyped_storage().data_ptr()
    assert (weight.view(torch.uint8) == 1).all() and (second == 2).all() and buffers.reused == 0
    first_memory = weight.untyped_storage().data_ptr()
    del weight, third
    again = buffers.take(600, align=4096)  # the first buffer, free now: read into again, at a 4 KiB boundary
    assert buffers.reused == 1 and again.data_ptr() % 4096 == 0
    assert again.untyped_storage().data_ptr() == first_memory
    larger = buffers.take(5000)  # the second is still seen (`second`), the first (`again`) too: new memory
    assert buffers.reused == 1 and larger.untyped_storage().data_ptr() not in (first_memory,
                                                                               second.untyped_storage().data_ptr())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_are_the_tables_rows(tmp_path, dtype):
    table = torch.randn(40, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    save_file({"before": torch.ones(3), "table": table}, tmp_path / "t.safetensors")
    files = TensorFiles([tmp_path / "t.safetensors"])
    try:
        for rows in ([], [0], [39], [2, 3, 4, 9, 10, 20, 39], list(range(40))):
            got = files.read_rows("table", rows)
            assert got.dtype == dtype and got.shape == (len(rows), 6) and torch.equal(got, table[rows]), rows
        for rows in ([40], [-1, 3], [3, 41]):
            with pytest.raises(IndexError):
                files.read_rows("table", rows)
    finally:
        files.close()


@pytest.mark.parametrize("direct", [True, False], ids=["past the page cache", "through the page cache"])
def test_every_tensor_read_lies_where_a_map_of_its_file_puts_it(tmp_path, direct):
    # A matrix-vector product's rounding depends on where its matrix lies, and from_pretrained's tensors lie where a
    # memory map of the file puts them: at their file offset modulo 64. So does every tensor read here, alone, side by
    # side or by rows, and the product over one position gives the same bits as the mapped tensor's.
    if direct and not direct_io_here(tmp_path):
        pytest.skip("this file system takes no O_DIRECT read")
    generator = torch.Generator().manual_seed(2)
    tensors = {"a": torch.randn(3, generator=generator), "w": torch.randn(96, 64, generator=generator),
               "n": torch.randn(5, generator=generator), "h": torch.randn(40, 64, generator=generator)}
    written(tmp_path / "model.safetensors", tensors)
    files = TensorFiles([tmp_path / "model.safetensors"])
    if not direct:
        files._direct = dict.fromkeys(files._direct)  # as on a file system that refuses O_DIRECT
    try:
        offsets = {name: files.entries[name].offset for name in tensors}
        alone = {name: files.read(name) for name in tensors}
        together = files.read_together(["w", "n", "h"], Buffers())
        assert files.direct_reads == int(direct)
        rows = files.read_rows("h", [3, 4, 5])
        for name, tensor in [*alone.items(), *together.items()]:
            assert tensor.data_ptr() % 64 == offsets[name] % 64 and torch.equal(tensor, tensors[name]), name
        assert rows.data_ptr() % 64 == (offsets["h"] + 3 * 64 * 4) % 64
        x = torch.randn(1, 64, generator=generator)
        with open(tmp_path / "model.safetensors", "rb") as f:
            view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable, nothing written back
        try:
            w = torch.frombuffer(view, dtype=torch.uint8)[offsets["w"]:offsets["w"] + 96 * 64 * 4].view(torch.float32)
            w = w.reshape(96, 64)
            assert w.data_ptr() % 64 == offsets["w"] % 64
            for got in (alone["w"], together["w"]):
                assert torch.equal(torch.nn.functional.linear(x, got), torch.nn.functional.linear(x, w))
            del w
        finally:
            view.close()
    finally:
        files.close()
