import numpy as np
import pyarrow as pa
import pytest

from klpipe.arrow import from_numpy, numpy_view


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
