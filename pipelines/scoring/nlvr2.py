"""NLVR2 accuracy and consistency as lil-lab/nlvr's `nlvr2/eval/metrics.py` computes them.

An identifier is `split-setid-pairid-sentid`; blanking the pair id names the sentence, written once
for several image pairs. A sentence is consistent when every one of its pairs is judged right;
consistency is the fraction of unique sentences that are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from pipelines.scoring.inputs import ScoringInputError, load_json, missing_error, required, rows_of

_BOOLEANS = {"true": True, "false": False}


def sentence_key(identifier: str) -> str:
    """The sentence of a statement: its identifier with the pair id (third part) blanked."""
    parts = identifier.split("-")
    if len(parts) != 4:
        raise ScoringInputError(
            f"NLVR2 identifier {identifier!r} is not split-setid-pairid-sentid (e.g. 'dev-850-0-0')"
        )
    parts[2] = ""
    return "-".join(parts)


def score_nlvr2(predictions: Mapping[str, bool], gold: Mapping[str, bool], source: str | None = None) -> dict:
    """`accuracy` and `consistency` in percent (two decimals). Every gold statement needs a prediction;
    predictions for other identifiers are ignored, as the official script does."""
    if not gold:
        raise ScoringInputError(f"{source or 'the gold set'}: no statements to score")
    missing = [ident for ident in gold if ident not in predictions]
    if missing:
        raise missing_error("statements", missing, source)
    right = 0
    consistent: dict[str, bool] = {}
    for ident, label in gold.items():
        ok = bool(predictions[ident]) == bool(label)
        right += ok
        key = sentence_key(ident)
        consistent[key] = consistent.get(key, True) and ok
    return {
        "accuracy": round(100 * right / len(gold), 2),
        "consistency": round(100 * sum(consistent.values()) / len(consistent), 2),
        "statements": len(gold),
        "sentences": len(consistent),
    }


def read_nlvr2_gold(path: str | os.PathLike) -> dict[str, bool]:
    """Identifier -> label from the official JSON lines (`"label": "True"|"False"`) or LXMERT's JSON
    list (`"label": 0|1`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScoringInputError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ScoringInputError(f"{path}: not UTF-8 text ({exc})") from None
    if text.lstrip().startswith("["):
        rows = [
            (f"{path} row {i}", row) for i, row in enumerate(rows_of(load_json(path), path, "statements"))
        ]
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path} line {lineno}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ScoringInputError(f"{path} line {lineno}: not valid JSON ({exc.msg})") from None
    gold: dict[str, bool] = {}
    for where, row in rows:
        if not isinstance(row, dict):
            raise ScoringInputError(f"{where}: expected a JSON object, got {type(row).__name__}")
        ident = required(row, "identifier", str, where)
        sentence_key(ident)
        if "label" not in row:
            raise ScoringInputError(f"{where} ({ident}): no 'label': this split is unlabelled")
        gold_label = _label(row["label"], f"{where} ({ident})")
        if ident in gold:
            raise ScoringInputError(f"{where}: identifier {ident!r} appears twice")
        gold[ident] = gold_label
    return gold


def _label(value: object, where: str) -> bool:
    if isinstance(value, str) and value.lower() in _BOOLEANS:
        return _BOOLEANS[value.lower()]
    if not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    raise ScoringInputError(f"{where}: label is {value!r}, expected 'True'/'False' or 0/1")


def read_nlvr2_predictions(path: str | os.PathLike) -> dict[str, bool]:
    """Identifier -> prediction from the CSV `identifier,True|False` (no header; case as the official
    script ignores it)."""
    path = Path(path)
    predictions: dict[str, bool] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                parts = line.strip().split(",")
                if len(parts) != 2:
                    raise ScoringInputError(
                        f"{where}: expected 'identifier,True|False', got {len(parts)} comma-separated fields"
                    )
                ident, value = parts[0].strip(), parts[1].strip()
                if value.lower() not in _BOOLEANS:
                    raise ScoringInputError(
                        f"{where} ({ident}): prediction is {value!r}, expected True or False"
                    )
                if ident in predictions:
                    raise ScoringInputError(f"{where}: identifier {ident!r} is predicted twice")
                predictions[ident] = _BOOLEANS[value.lower()]
    except FileNotFoundError:
        raise ScoringInputError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ScoringInputError(f"{path}: not UTF-8 text ({exc})") from None
    return predictions


def score_nlvr2_files(predictions: str | os.PathLike, gold: str | os.PathLike) -> dict:
    """`score_nlvr2` of a predictions CSV against the official JSON lines (or LXMERT's JSON)."""
    return score_nlvr2(read_nlvr2_predictions(predictions), read_nlvr2_gold(gold), source=str(gold))
