"""Row files people already have (a JSON list, JSON lines, CSV/TSV, a HF `datasets` Parquet/Arrow
export), each row with the line it starts on, and refusals that list every problem of a file at once."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from model.files import JSON_LIMIT, MAX_DEPTH, nesting_depth, regular_file

MAX_LISTED = 8  # rows named in one refusal; the rest are counted
MAX_LINE = 1 << 20  # bytes in one CSV/TSV line: a row is a few hundred (csv's own field limit is 128 KiB)
BINARY = "{path}: a binary file, not JSON, JSON lines or CSV rows; give the row file"
DATASETS_SUFFIXES = frozenset({".parquet", ".arrow"})


class RowFileError(ValueError):
    """A row file is unreadable or some of its rows are malformed; the message names the file and lines.
    `rows` and `problems` (else None): the readable rows and the problems, when the file could be read past
    its malformed lines (a CSV line of too few values), for a reader to add its own (`rows_and_problems`)."""

    rows: list[Row] | None = None
    problems: RowProblems | None = None


@dataclass(frozen=True)
class Row:
    """One row's fields and where it is: `line` (1-based) in text files, `index` (1-based) among the rows;
    `where` says it as an error message should (`line 7`, `row 3 (line 12)` in a JSON list, `row 3`)."""

    fields: dict[str, Any]
    line: int | None
    index: int

    @property
    def where(self) -> str:
        if self.line is None:
            return f"row {self.index}"
        return f"line {self.line}" if self.index == 0 else f"row {self.index} (line {self.line})"


def kind_of(value: object) -> str:
    """What a JSON value is, in the words of an error message ("a number", "a list")."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text" if value.strip() else "empty"
    if value is None:
        return "null"
    if isinstance(value, BadCell):
        return value.reason
    return {"list": "a list", "dict": "an object"}.get(type(value).__name__, type(value).__name__)


@dataclass(frozen=True)
class BadCell:
    """A cell that opens like JSON but cannot be read as it (`reason`): no value, a problem to name."""

    reason: str


def json_cell(value: object, strict: bool = False) -> object:
    """A CSV cell holding a JSON list or object is that list or object; anything else is itself. A cell
    nested deeper than MAX_DEPTH is a BadCell, as is, with `strict` (a field that only holds JSON or plain
    words), one that opens like JSON but is malformed: it would otherwise be read as literal text."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            return BadCell(f"malformed JSON ({exc.msg} at column {exc.colno})") if strict else value
        except RecursionError:
            return BadCell(f"JSON nested deeper than {MAX_DEPTH} levels")
        if nesting_depth(parsed) > MAX_DEPTH:
            return BadCell(f"JSON nested deeper than {MAX_DEPTH} levels")
        return parsed
    return value


class RowProblems:
    """Problems found while reading a file's rows, raised together as one line (`raise_if_any`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.by_row: dict[str, list[str]] = {}

    def add(self, row: Row | str, problem: str) -> None:
        where = row.where if isinstance(row, Row) else row
        self.by_row.setdefault(where, []).append(problem)

    def __bool__(self) -> bool:
        return bool(self.by_row)

    def raise_if_any(self, expected: str) -> None:
        """RowFileError naming the file, each bad row (up to MAX_LISTED) with all its problems, and the
        row the file should hold."""
        if not self.by_row:
            return
        listed = sorted(self.by_row.items(), key=lambda item: _line_order(item[0]))[:MAX_LISTED]
        parts = [f"{where}: {', '.join(problems)}" for where, problems in listed]
        more = len(self.by_row) - len(listed)
        tail = f"; and {more} more rows" if more > 0 else ""
        raise RowFileError(f"{self.path}: {'; '.join(parts)}{tail}; expected rows like {expected}")


def _line_order(where: str) -> int:
    """Where a problem is (`line 7`, `row 3 (line 12)`, `row 3`) as a number, to list them in file order."""
    numbers = re.findall(r"\d+", where)
    return int(numbers[-1]) if numbers else 0


def rows_and_problems(path: str | Path) -> tuple[list[Row], RowProblems]:
    """The readable rows of `path` and the problems of its malformed lines, for a reader that adds its own
    problems to name every one at once (a file that cannot be read at all still raises RowFileError)."""
    try:
        return read_row_file(path), RowProblems(path)
    except RowFileError as exc:
        if exc.rows is None or exc.problems is None:
            raise
        return exc.rows, exc.problems


def read_row_file(path: str | Path) -> list[Row]:
    """The rows of `path` by its content or suffix: .csv/.tsv tables, .parquet/.arrow files and
    `save_to_disk` folders through HF `datasets`, otherwise JSON (a list of objects, an object with one
    list of objects such as {"questions": [...]}, or one object per line)."""
    path = Path(path)
    if path.is_dir():
        return _read_with_datasets(path)
    try:
        # a FIFO, a device or a huge file would hang or exhaust memory before any row is read
        regular_file(path, "row file", JSON_LIMIT)
    except ValueError as exc:
        raise RowFileError(str(exc)) from None
    if path.suffix.lower() in DATASETS_SUFFIXES:
        return _read_with_datasets(path)
    try:
        if path.suffix.lower() in (".csv", ".tsv"):
            with open(path, "rb") as fh:  # streamed: a line is held alone, and only up to MAX_LINE
                return _read_csv(path, _csv_lines(path, fh), "\t" if path.suffix.lower() == ".tsv" else ",")
        raw = path.read_bytes()
    except OSError as exc:
        raise RowFileError(f"cannot read {path}: {exc.strerror}; check the path") from exc
    if b"\0" in raw[:4096]:
        raise RowFileError(BINARY.format(path=path))
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RowFileError(f"{path}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from exc
    return _read_json(path, text)


def _csv_lines(path: Path, fh: BinaryIO) -> Iterator[str]:
    """The lines of a CSV/TSV file, decoded one at a time; a line longer than MAX_LINE bytes is refused
    naming it, before more of it is read."""
    if b"\0" in fh.peek(4096)[:4096]:
        raise RowFileError(BINARY.format(path=path))
    for n, raw in enumerate(iter(lambda: fh.readline(MAX_LINE + 1), b""), 1):
        if len(raw) > MAX_LINE:
            raise RowFileError(
                f"{path}: line {n} is longer than {MAX_LINE} bytes, far beyond any row; is it the right "
                "file, with line breaks?"
            )
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RowFileError(
                f"{path}: line {n} is not UTF-8 text (byte {exc.start}); save the file as UTF-8"
            ) from None
        # byte order marks before the header (two, when a BOM-less tool saved a BOM file again)
        yield line.lstrip("\ufeff") if n == 1 else line


def _read_json(path: Path, text: str) -> list[Row]:
    stripped = text.lstrip()
    if not stripped:
        raise RowFileError(f"{path}: the file is empty; give a JSON list of rows or one row per line")
    if stripped[0] == "[" or (stripped[0] == "{" and _is_one_document(text)):
        return _read_json_document(path, text)
    return _read_json_lines(path, text)


def _is_one_document(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def _read_json_document(path: Path, text: str) -> list[Row]:
    """A JSON list (or an object holding exactly one list of objects), each row with its start line."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowFileError(f"{path}: line {exc.lineno}: not valid JSON ({exc.msg}); fix the file") from exc
    except RecursionError:
        raise RowFileError(f"{path}: JSON nested too deeply to read; fix the file") from None
    if isinstance(data, dict):
        lists = [k for k, v in data.items() if isinstance(v, list) and v and isinstance(v[0], dict)]
        if len(lists) != 1:
            raise RowFileError(
                f"{path}: a JSON object with keys {sorted(data)[:8]}, not a list of rows; "
                "give a JSON list of rows, one row per line, or an object holding one list of rows"
            )
        return _rows_of(path, data[lists[0]], _item_lines(text, lists[0]))
    return _rows_of(path, data, _item_lines(text, None))


def _rows_of(path: Path, items: list, lines: list[int]) -> list[Row]:
    problems = RowProblems(path)
    rows = []
    for i, item in enumerate(items):
        line = lines[i] if i < len(lines) else i + 1
        if not isinstance(item, dict):
            problems.add(f"row {i + 1} (line {line})", f"{kind_of(item)}, not an object")
            continue
        rows.append(Row(item, line, i + 1))
    problems.raise_if_any("one JSON object per row")
    return rows


def _item_lines(text: str, key: str | None) -> list[int]:
    """The line each element of the top-level list (or of `data[key]`) starts on."""
    decoder = json.JSONDecoder()
    pos = text.index("[") if key is None else _list_start(text, key)
    lines = []
    pos += 1
    n = len(text)
    line, counted = 1, 0  # newlines counted up to `counted`: each stretch of text is counted once
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            break
        line += text.count("\n", counted, pos)
        counted = pos
        lines.append(line)
        _, pos = decoder.raw_decode(text, pos)
    return lines


def _list_start(text: str, key: str) -> int:
    """Where the list under top-level `key` opens (the document is known valid)."""
    decoder = json.JSONDecoder()
    pos = text.index("{") + 1
    while True:
        while text[pos] in " \t\r\n,":
            pos += 1
        name, pos = decoder.raw_decode(text, pos)
        while text[pos] in " \t\r\n:":
            pos += 1
        if name == key:
            return pos
        _, pos = decoder.raw_decode(text, pos)


def _read_json_lines(path: Path, text: str) -> list[Row]:
    problems = RowProblems(path)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.add(f"line {n}", f"not valid JSON ({exc.msg} at column {exc.colno})")
            continue
        except RecursionError:
            problems.add(f"line {n}", "JSON nested too deeply to read")
            continue
        if not isinstance(item, dict):
            problems.add(f"line {n}", f"{kind_of(item)}, not an object")
            continue
        rows.append(Row(item, n, 0))
    problems.raise_if_any("one JSON object per line (or a JSON list of objects)")
    return rows


def _read_csv(path: Path, lines: Iterable[str], delimiter: str) -> list[Row]:
    reader = csv.reader(lines, delimiter=delimiter)
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise RowFileError(f"{path}: the file is empty; give a header line then one row per line") from None
    problems = RowProblems(path)
    blank = [i + 1 for i, h in enumerate(header) if not h]
    if blank:
        problems.add("line 1", f"column(s) {blank} have no name in the header")
    rows = []
    end = reader.line_num
    try:
        for values in reader:
            # a row starts on the line after the last one ended: a quoted value may span lines, and an
            # unbalanced quote swallows many, so a problem is named where its row starts
            line, end = end + 1, reader.line_num
            if not any(v.strip() for v in values):
                continue
            if len(values) != len(header):
                spans = f" (a quote opened on this line runs to line {end})" if end > line else ""
                problems.add(
                    f"line {line}", f"{len(values)} values for the header's {len(header)} columns{spans}"
                )
                continue
            rows.append(Row({h: v for h, v in zip(header, values, strict=True) if h}, line, 0))
    except csv.Error as exc:
        opened = f" (a quote opened on line {end + 1} may be unbalanced)" if reader.line_num > end + 1 else ""
        problems.add(f"line {end + 1}", f"not valid CSV ({exc}){opened}")
    try:
        problems.raise_if_any(f"the header's columns {header}")
    except RowFileError as exc:
        exc.rows, exc.problems = rows, problems
        raise
    return rows


def _read_with_datasets(path: Path) -> list[Row]:
    """Rows of a HF `datasets` export: a Parquet or Arrow file, or a `save_to_disk` folder."""
    try:
        import datasets
    except ImportError as exc:
        raise RowFileError(f"{path}: reading Parquet/Arrow exports needs `pip install datasets`") from exc
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                raise RowFileError(
                    f"{path}: a DatasetDict with splits {sorted(data)}; give one split's folder "
                    f"({path}/{next(iter(data))})"
                )
        else:
            kind = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
            data = datasets.load_dataset(kind, data_files=str(path), split="train")
    except FileNotFoundError as exc:
        raise RowFileError(f"cannot read {path}: {exc}; check the path") from exc
    except (ValueError, OSError) as exc:
        if isinstance(exc, RowFileError):
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RowFileError(f"{path}: not a readable datasets export ({first})") from exc
    for name, feature in data.features.items():
        if isinstance(feature, datasets.Image):  # keep {"path", "bytes"}: the rows name images, not pixels
            data = data.cast_column(name, datasets.Image(decode=False))
    return [Row(dict(item), None, i + 1) for i, item in enumerate(data)]
