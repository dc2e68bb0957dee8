"""The formats table: suffixes pick the format, options a format does not take are refused by name."""

from __future__ import annotations

import pytest

from pipelines.cli import main
from storage.formats import FORMATS, format_of, options_for


def test_every_suffix_picks_its_format_and_names_win():
    for fmt in FORMATS.values():
        for suffix in fmt.suffixes:
            assert format_of(f"feats{suffix.upper()}") is fmt
    assert format_of("feats.bin", "tsv") is FORMATS["tsv"]
    with pytest.raises(ValueError, match=r"cannot tell the format of feats.bin.*\.tsv.*--format"):
        format_of("feats.bin")
    with pytest.raises(ValueError, match="unknown feature format 'npz'"):
        format_of("feats.npz", "npz")


def test_options_a_format_does_not_take_are_refused():
    assert options_for(FORMATS["hdf5"], {"ids": "map.json"}, FORMATS["hdf5"].read_options, "sources") == {
        "ids": "map.json"
    }
    with pytest.raises(ValueError, match="--ids does not apply to tsv sources"):
        options_for(FORMATS["tsv"], {"ids": "map.json"}, FORMATS["tsv"].read_options, "sources")
    assert options_for(FORMATS["tsv"], {"ids": None}, (), "sources") == {}


def test_the_cli_refuses_a_misplaced_option_in_one_line(tmp_path, caplog):
    src = tmp_path / "feats.tsv"
    src.write_text("")
    assert main(["features", "import", str(src), str(tmp_path / "s.lmdb"), "--ids", "m.json"]) == 1
    assert "--ids does not apply to tsv sources" in caplog.text
    assert not (tmp_path / "s.lmdb").exists()
