"""Issue 46: row files that are hostile in size or shape (a 256 MiB line, JSON nested 100k deep, a double
BOM, an unbalanced quote, a malformed JSON answers cell) end in one line naming the file and the line."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pipelines.data.captions import CaptionDataError, read_caption_file
from pipelines.data.qa import load_qa_examples
from pipelines.data.row_files import RowFileError, read_row_file

DEEP = "[" * 100_000 + "]" * 100_000
DEEP_CELL = "[" * 40_000 + "]" * 40_000  # within csv's 128 KiB field limit, 40x the parser's recursion limit


def test_a_csv_line_of_256_mib_is_refused_without_being_read(tmp_path):
    """The file is sparse (no disk): its second line runs for 256 MiB. Streamed with a per-line limit, the
    reader's peak memory grows by < 32 MB (it grew by the file size several times over when read whole)."""
    path = tmp_path / "q.csv"
    with open(path, "wb") as fh:
        fh.write(b"image,question,answer\n" + b"a.jpg,what," + b"x" * 8192)
        fh.truncate(256 << 20)
    script = f"""
        from pipelines.data.qa import load_qa_examples

        def peak():
            return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) >> 10

        before = peak()
        try:
            load_qa_examples({str(path)!r})
        except ValueError as exc:
            print(exc)
        print(peak() - before)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    error, grew_mb = proc.stdout.splitlines()
    assert f"{path}: line 2 is longer than 1048576 bytes" in error and int(grew_mb) < 32, proc.stdout


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            f"image,question,answers\na.jpg,what?,{DEEP_CELL}\n",
            "line 2: 'answers' is JSON nested deeper than 64",
        ),
        ('image,question,answers\na.jpg,what?,"[""red"", ""blue"""\n', "line 2: 'answers' is malformed JSON"),
        ('image,question,label\na.jpg,what?,"{""red"": 1"\n', "line 2: 'label' must map answers to scores"),
    ],
)
def test_answers_cells_that_are_not_json_are_named(text, needle, tmp_path):
    (tmp_path / "q.csv").write_text(text)
    with pytest.raises(ValueError, match="q.csv") as err:
        load_qa_examples(tmp_path / "q.csv")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_karpathy_file_nested_100k_deep_is_one_line(tmp_path):
    (tmp_path / "dataset_coco.json").write_text('{"images": ' + DEEP + "}")
    with pytest.raises(CaptionDataError, match="nested deeper than 64 levels"):
        read_caption_file(tmp_path / "dataset_coco.json")


def test_a_double_bom_before_the_header_is_read_past(tmp_path):
    (tmp_path / "q.csv").write_bytes("\ufeff\ufeffimage,question,answer\na.jpg,what?,red\n".encode())
    assert [row.fields for row in read_row_file(tmp_path / "q.csv")] == [
        {"image": "a.jpg", "question": "what?", "answer": "red"}
    ]


def test_an_unbalanced_quote_is_named_where_it_opens(tmp_path):
    lines = ["image,question,answer", 'a.jpg,"what?,red'] + [f"b{i}.jpg,why?,blue" for i in range(116)]
    (tmp_path / "q.csv").write_text("\n".join(lines) + '\nc.jpg,x"\n')
    with pytest.raises(RowFileError) as err:
        read_row_file(tmp_path / "q.csv")
    assert "line 2: " in str(err.value) and "a quote opened on this line runs to line 119" in str(err.value)
