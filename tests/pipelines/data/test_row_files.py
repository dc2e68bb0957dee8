"""pipelines.data.row_files refuses what would hang or crash it: FIFOs, devices, deep nesting."""

from __future__ import annotations

import pytest

from pipelines.data.row_files import RowFileError, read_row_file


@pytest.mark.parametrize("layout", ["list", "lines"])
def test_rows_nested_too_deeply_are_one_error(tmp_path, layout):
    deep = "[" * 100_000 + "]" * 100_000
    text = f'[{{"a": {deep}}}]' if layout == "list" else f'{{"a": {deep}}}\n'
    path = tmp_path / "rows.json"
    path.write_text(text)
    with pytest.raises(RowFileError, match="nested too deeply") as err:
        read_row_file(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["rows.json", "rows.csv", "rows.parquet"])
def test_a_fifo_or_device_is_refused_before_reading(tmp_path, name):
    import os

    fifo = tmp_path / name
    os.mkfifo(fifo)
    with pytest.raises(RowFileError, match="not a regular file"):
        read_row_file(fifo)
    with pytest.raises(RowFileError, match="not a regular file"):
        read_row_file("/dev/zero")
