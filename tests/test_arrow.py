import numpy as np
import pyarrow as pa
import pytest

from klpipe.arrow import (
    first_null,
    first_null_in_lists,
    from_numpy,
    is_list_type,
    list_array,
    list_values,
    numpy_view,
    offsets_from_lengths,
)


@pytest.mark.parametrize("kind", [pa.float16(), pa.float32(), pa.float64(), pa.int8(), pa.int32(), pa.uint64()])
def test_numpy_view_honours_slices(kind):
    array = pa.array([1, 2, 3, 4, 5], type=kind)
    assert numpy_view(array.slice(1, 3)).tolist() == [2, 3, 4]
    assert numpy_view(array.slice(5, 0)).tolist() == []
    assert numpy_view(array).dtype == np.dtype(kind.to_pandas_dtype())


def test_numpy_view_refuses_non_numeric_arrays():
    with pytest.raises(TypeError, match="numpy_view needs a numeric array, got bool"):
        numpy_view(pa.array([True]))


def test_from_numpy_shares_memory_and_round_trips():
    values = np.array([0.5, -1.0, 2.0])
    array = from_numpy(values)
    assert array.type == pa.float64() and array.to_pylist() == [0.5, -1.0, 2.0] and array.null_count == 0
    assert from_numpy(np.arange(10, dtype=np.int32)[::2]).to_pylist() == [0, 2, 4, 6, 8]  # strided: copied


def test_list_values_of_slices_and_chunked_arrays():
    lists = pa.array([[-1.0], [-0.5, -0.25], [], [-4.0, -1.0, 0.0], [-1.0]], pa.list_(pa.float32()))
    values, offsets = list_values(lists.slice(3, 2))
    assert values.tolist() == [-4.0, -1.0, 0.0, -1.0] and offsets.tolist() == [0, 3, 4]
    values, offsets = list_values(pa.chunked_array([lists.slice(0, 2), lists.slice(4)]))
    assert values.tolist() == [-1.0, -0.5, -0.25, -1.0] and offsets.tolist() == [0, 1, 3, 4]


def test_list_array_from_offsets_and_values():
    offsets = offsets_from_lengths([2, 0, 1])
    assert offsets.tolist() == [0, 2, 2, 3] and offsets.dtype == np.int64
    built = list_array(offsets, np.array([7, 8, 9], dtype=np.int32))
    assert built.type == pa.list_(pa.int32()) and built.to_pylist() == [[7, 8], [], [9]]
    assert list_array(offsets_from_lengths([]), np.zeros(0, np.float32)).to_pylist() == []


def test_is_list_type():
    assert is_list_type(pa.list_(pa.int32())) and is_list_type(pa.large_list(pa.float64()))
    assert not is_list_type(pa.string()) and not is_list_type(pa.list_view(pa.int32()))


def test_first_null_and_the_row_of_the_first_null_value():
    assert first_null(pa.array([1, 2])) is None
    assert first_null(pa.chunked_array([pa.array(["a", "b"]), pa.array(["c", None, None])])) == 3
    lists = pa.array([[1], [2, None], [3], [None]])
    assert first_null_in_lists(lists) == 1
    assert first_null_in_lists(lists.slice(2)) == 1  # rows of the slice, not of the parent
    assert first_null_in_lists(lists.slice(2, 1)) is None
    assert first_null_in_lists(pa.array([], pa.list_(pa.int64()))) is None
