"""The COCO caption evaluation through pycocoevalcap: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D and SPICE.

The PTB tokenizer, METEOR and SPICE run Java; SPICE also needs the Stanford CoreNLP jars that
pycocoevalcap otherwise downloads on first use. A metric that cannot run is reported as skipped,
with the reason, instead of failing the whole evaluation.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.scoring.inputs import ScoringInputError, load_json, required, rows_of

# pycocoevalcap's PTB tokenizer drops these tokens after tokenising.
_PUNCTUATION = {
    "''",
    "'",
    "``",
    "`",
    "-LRB-",
    "-RRB-",
    "-LCB-",
    "-RCB-",
    ".",
    "?",
    "!",
    ",",
    ":",
    "-",
    "--",
    "...",
    ";",
}
SPICE_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")
METRIC_NAMES = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")


@dataclass
class CaptionScores:
    """Corpus-level metrics (pycocoevalcap names), per-image scores, and what was skipped and why."""

    metrics: dict[str, float] = field(default_factory=dict)
    per_image: dict[str, list[float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per metric (×100 as papers report them), then one per skipped metric."""
        lines = [f"{name:8s} {100 * value:6.2f}" for name, value in self.metrics.items()]
        lines += [f"{name:8s} skipped: {reason}" for name, reason in self.skipped.items()]
        return "\n".join(lines)


def java_available() -> bool:
    return shutil.which("java") is not None


def simple_tokenize(caption: str) -> str:
    """Lower-case words with punctuation removed: the fallback when the PTB tokenizer cannot run."""
    return " ".join(re.findall(r"[a-z0-9]+(?:'[a-z]+)?", caption.lower()))


def _pycocoevalcap_dir() -> Path:
    import pycocoevalcap.cider.cider as cider_module

    return Path(cider_module.__file__).resolve().parent.parent


def tokenize(
    captions: Mapping[Hashable, Sequence[str]], skipped: dict[str, str], java: bool = True
) -> dict[Hashable, list[str]]:
    """PTB-tokenise every caption (pycocoevalcap's tokenizer); falls back to `simple_tokenize`."""
    if not java:
        reason = "not requested (java=False); used a lower-case word tokenizer instead"
    elif java_available():
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        try:
            return PTBTokenizer().tokenize(
                {key: [{"caption": c} for c in caps] for key, caps in captions.items()}
            )
        except OSError as err:
            reason = f"the PTB tokenizer failed ({err}); used a lower-case word tokenizer instead"
    else:
        reason = "java not found on PATH; used a lower-case word tokenizer instead (install a JRE for PTB)"
    skipped["PTBTokenizer"] = reason
    return {key: [simple_tokenize(c) for c in caps] for key, caps in captions.items()}


def _spice_missing() -> str | None:
    if not java_available():
        return "java not found on PATH (install a JRE)"
    lib = _pycocoevalcap_dir() / "spice" / "lib"
    missing = [jar for jar in SPICE_JARS if not (lib / jar).is_file()]
    if missing:
        return (
            f"Stanford CoreNLP models {missing} are not in {lib} (pycocoevalcap downloads them from "
            "nlp.stanford.edu on first use; copy them there to enable SPICE)"
        )
    return None


def evaluate_captions(
    references: Mapping[Hashable, Sequence[str]],
    predictions: Mapping[Hashable, str],
    spice: bool = True,
    pretokenized: bool = False,
    java: bool = True,
) -> CaptionScores:
    """Score one predicted caption per image against its raw reference captions, as the COCO server does.

    `pretokenized`: captions are already lower-case space-separated tokens (skips the PTB tokenizer);
    `java=False` runs only the Python metrics (BLEU, ROUGE-L, CIDEr-D), e.g. for validation during training.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    missing = sorted(set(predictions) - set(references))
    if missing:
        raise ValueError(f"{len(missing)} predicted image(s) have no references, e.g. {missing[:3]}")
    if not predictions:
        raise ValueError("no predictions to score")
    keys = sorted(predictions, key=str)
    result = CaptionScores()
    gts = {key: list(references[key]) for key in keys}
    res = {key: [predictions[key]] for key in keys}
    if not pretokenized:
        # One tokenizer run (one Java start) for references and predictions together.
        tagged = {**{("ref", k): v for k, v in gts.items()}, **{("res", k): v for k, v in res.items()}}
        both = tokenize(tagged, result.skipped, java)
        gts = {key: both[("ref", key)] for key in keys}
        res = {key: both[("res", key)] for key in keys}
    empty = [key for key in keys if not gts[key]]
    if empty:
        raise ValueError(f"{len(empty)} image(s) have no reference captions, e.g. {empty[:3]}")

    def record(names: Sequence[str], score: Sequence[float], scores: Sequence[Sequence[float]]) -> None:
        for name, value, values in zip(names, score, scores, strict=True):
            result.metrics[name] = float(value)
            result.per_image[name] = [float(v) for v in values]

    bleu, bleu_each = Bleu(4).compute_score(gts, res, verbose=0)
    record(METRIC_NAMES[:4], bleu, bleu_each)
    if not java:
        result.skipped["METEOR"] = "not requested (java=False)"
    elif java_available():
        from pycocoevalcap.meteor.meteor import Meteor

        meteor, meteor_each = Meteor().compute_score(gts, res)
        record(["METEOR"], [meteor], [meteor_each])
    else:
        result.skipped["METEOR"] = "java not found on PATH (install a JRE)"
    rouge, rouge_each = Rouge().compute_score(gts, res)
    record(["ROUGE_L"], [rouge], [rouge_each])
    cider, cider_each = Cider().compute_score(gts, res)
    record(["CIDEr"], [cider], [cider_each])
    reason = _spice_missing() if spice and java else "not requested"
    if reason is None:
        from pycocoevalcap.spice.spice import Spice

        spice_score, spice_each = Spice().compute_score(gts, res)
        record(["SPICE"], [spice_score], [[item["All"]["f"] for item in spice_each]])
    else:
        result.skipped["SPICE"] = reason
    return result


def read_caption_results(path: str | os.PathLike) -> dict[int, str]:
    """Image id -> caption from a COCO caption results file `[{"image_id": int, "caption": str}, ...]`
    (one caption per image, as the COCO evaluation asserts)."""
    results: dict[int, str] = {}
    for i, row in enumerate(rows_of(load_json(path), path, "caption results")):
        where = f"{path} row {i}"
        image_id = required(row, "image_id", int, where)
        if image_id in results:
            raise ScoringInputError(f"{where}: image {image_id} has a second caption; give one per image")
        results[image_id] = required(row, "caption", str, f"{where} (image {image_id})")
    if not results:
        raise ScoringInputError(f"{path}: no captions to score")
    return results
