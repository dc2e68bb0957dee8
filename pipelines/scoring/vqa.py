"""VQA v2 accuracy as the official evaluation (GT-Vision-Lab/VQA `vqaEval.py`) computes it, in either
of the script's two versions in use (`EVALUATORS`):

- "2017" (papers up to 2021 were scored with it): the prediction is always normalised (punctuation,
  number words, articles, contractions); the 10 human answers only have their punctuation processed,
  and only when they are not all identical.
- "2021" (the repository's current script, "Fixed processing answers bug"): human answers are stripped;
  when they are not all identical, they and the prediction are normalised alike; when they are, nothing is.

A question scores the mean over the 10 leave-one-out subsets of min(#humans in the subset equal to the
prediction / 3, 1).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipelines.scoring.inputs import ScoringInputError, load_json, missing_error, required, rows_of

EVALUATORS = ("2017", "2021")
DEFAULT_EVALUATOR = "2021"  # the repository's current version
# Replaced by a space, or removed when the answer has it next to a space or has a digit,digit group.
PUNCTUATION = tuple(';/[]"{}()=+\\_-><@`,?!')
# A period not followed by a digit is dropped. The official pattern starts with `(?!<=\d)`, a lookahead
# that never matches at a period, so "not followed by a digit" is the whole rule; it also passes
# `re.UNICODE` (32) where `re.sub` takes its count, so at most 32 periods go.
_PERIOD = re.compile(r"\.(?!\d)")
_PERIODS_DROPPED = 32
_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
NUMBER_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}
ARTICLES = frozenset({"a", "an", "the"})
# The official table, less its keys with capitals (words are lowercased before the lookup, so they never
# apply) and its entries that map a word to itself; "somebody'd" -> "somebodyd" is the table's own.
CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's",
    "howd": "how'd", "howll": "how'll", "hows": "how's", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've",
    "it'dve": "it'd've", "itll": "it'll", "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't", "mustve": "must've",
    "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't",
    "shed've": "she'd've", "she'dve": "she'd've", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've",
    "someone'dve": "someone'd've", "someonell": "someone'll", "someones": "someone's",
    "somethingd": "something'd", "somethingd've": "something'd've", "something'dve": "something'd've",
    "somethingll": "something'll", "thats": "that's", "thered": "there'd", "thered've": "there'd've",
    "there'dve": "there'd've", "therere": "there're", "theres": "there's", "theyd": "they'd",
    "theyd've": "they'd've", "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're",
    "theyve": "they've", "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've",
    "weve": "we've", "werent": "weren't", "whatll": "what'll", "whatre": "what're", "whats": "what's",
    "whatve": "what've", "whens": "when's", "whered": "where'd", "wheres": "where's", "whereve": "where've",
    "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've", "wholl": "who'll", "whos": "who's",
    "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's", "wont": "won't",
    "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've",
    "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll", "yall'd've": "y'all'd've",
    "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd", "youd've": "you'd've",
    "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}  # fmt: skip


@dataclass(frozen=True)
class VQAGold:
    """One question's truth: the 10 human answers (official annotations) or, in LXMERT's files, the
    soft score of each answer (`label`)."""

    question_id: int
    answers: tuple[str, ...] = ()
    label: dict[str, float] | None = field(default=None, compare=False)
    answer_type: str | None = None
    question_type: str | None = None


def process_punctuation(text: str) -> str:
    """The official punctuation rule (see the module docstring)."""
    remove_all = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for p in PUNCTUATION:
        # the decision looks at the original text, the replacement works on the running result
        if remove_all or p + " " in text or " " + p in text:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD.sub("", out, count=_PERIODS_DROPPED)


def process_digit_article(text: str) -> str:
    """Lowercase, number words to digits, articles dropped, contractions restored."""
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in ARTICLES)


def _clean(answer: str) -> str:
    return answer.replace("\n", " ").replace("\t", " ").strip()


def normalize_prediction(answer: str) -> str:
    """A predicted answer as the 2017 evaluation always compares it (and the 2021 one when the humans
    disagree)."""
    return process_digit_article(process_punctuation(_clean(answer)))


def evaluator_name(evaluator: str) -> str:
    """How a score names the script that computed it."""
    return f"vqaEval.py {evaluator}"


def check_evaluator(evaluator: str) -> str:
    if evaluator not in EVALUATORS:
        raise ValueError(f"unknown VQA evaluator {evaluator!r}; choose one of {list(EVALUATORS)}")
    return evaluator


def question_accuracy(prediction: str, answers: Sequence[str], evaluator: str = DEFAULT_EVALUATOR) -> float:
    """Official accuracy (0..1) of a raw predicted answer against the human answers of one question, as
    the `evaluator` version of vqaEval.py computes it."""
    if not answers:
        raise ValueError("a VQA question needs human answers to be scored")
    if check_evaluator(evaluator) == "2017":
        predicted = normalize_prediction(prediction)
        if len(set(answers)) > 1:
            answers = [process_punctuation(a) for a in answers]
    else:
        predicted = _clean(prediction)
        answers = [_clean(a) for a in answers]
        if len(set(answers)) > 1:
            answers = [process_digit_article(process_punctuation(a)) for a in answers]
            predicted = process_digit_article(process_punctuation(predicted))
    equal = [a == predicted for a in answers]
    matches = sum(equal)
    return sum(min(1, (matches - held_out) / 3) for held_out in equal) / len(equal)


def soft_score(prediction: str, label: Mapping[str, float]) -> float:
    """LXMERT's approximation: the soft score its file gives the normalised predicted answer."""
    return float(label.get(normalize_prediction(prediction), 0.0))


def score_vqa(
    predictions: Mapping[int, str],
    gold: Mapping[int, VQAGold],
    source: str | None = None,
    evaluator: str = DEFAULT_EVALUATOR,
) -> dict:
    """Accuracy in percent (two decimals) overall, `per_answer_type` and `per_question_type`.

    Every gold question needs a prediction and every prediction a gold question, as the official
    evaluation asserts. `method` is "official" when all questions carry their human answers, else
    "lxmert-soft-labels" (the approximation through LXMERT's label scores); `evaluator` names the
    vqaEval.py version that scored the human answers (absent for soft labels, which have none).
    """
    check_evaluator(evaluator)
    if not gold:
        raise ScoringInputError(f"{source or 'the gold set'}: no questions to score")
    missing = [qid for qid in gold if qid not in predictions]
    if missing:
        raise missing_error("questions", missing, source)
    extra = [qid for qid in predictions if qid not in gold]
    if extra:
        shown = ", ".join(repr(q) for q in extra[:5])
        raise ScoringInputError(
            f"{len(extra)} predicted question ids are not in {source or 'the gold set'} (e.g. {shown}): "
            "score against the annotations of the split that was predicted"
        )
    scores: list[float] = []
    per_answer_type: dict[str, list[float]] = defaultdict(list)
    per_question_type: dict[str, list[float]] = defaultdict(list)
    official = True
    for qid, truth in gold.items():
        if truth.answers:
            score = question_accuracy(predictions[qid], truth.answers, evaluator)
        else:
            official = False
            score = soft_score(predictions[qid], truth.label or {})
        scores.append(score)
        if truth.answer_type is not None:
            per_answer_type[truth.answer_type].append(score)
        if truth.question_type is not None:
            per_question_type[truth.question_type].append(score)
    result = {
        "accuracy": percent(scores),
        "per_answer_type": {k: percent(v) for k, v in per_answer_type.items()},
        "per_question_type": {k: percent(v) for k, v in per_question_type.items()},
        "questions": len(scores),
        "method": "official" if official else "lxmert-soft-labels",
    }
    if official:
        result["evaluator"] = evaluator_name(evaluator)
    return result


def percent(scores: Sequence[float]) -> float:
    """100 x mean, two decimals, in the official script's order of operations."""
    return round(100 * float(sum(scores)) / len(scores), 2)


def read_vqa_gold(path: str | os.PathLike, questions: str | os.PathLike | None = None) -> dict[int, VQAGold]:
    """Question id -> truth, in file order, from the official annotations JSON (`{"annotations": [...]}`,
    optionally checked against the official questions JSON) or LXMERT's rows with `label` scores."""
    data = load_json(path)
    if isinstance(data, dict) and "annotations" in data:
        gold = _official_gold(data["annotations"], path)
    elif isinstance(data, dict) and "questions" in data:
        raise ScoringInputError(
            f"{path}: this is a questions file; score against the annotations file "
            "(e.g. v2_mscoco_val2014_annotations.json), optionally with the questions beside it"
        )
    elif isinstance(data, list):
        gold = _lxmert_gold(data, path)
    else:
        raise ScoringInputError(
            f"{path}: neither the official VQA annotations ({{'annotations': [...]}}) nor LXMERT's JSON rows"
        )
    if questions is not None:
        _check_questions(questions, gold, path)
    return gold


def _official_gold(annotations: object, path: str | os.PathLike) -> dict[int, VQAGold]:
    gold: dict[int, VQAGold] = {}
    for i, row in enumerate(rows_of(annotations, path, "annotations")):
        where = f"{path} annotation {i}"
        qid = required(row, "question_id", int, where)
        answers = required(row, "answers", list, f"{where} (question {qid})")
        humans = []
        for j, answer in enumerate(answers):
            if not isinstance(answer, dict):
                raise ScoringInputError(f"{where} (question {qid}) answer {j}: expected an object")
            humans.append(required(answer, "answer", str, f"{where} (question {qid}) answer {j}"))
        if not humans:
            raise ScoringInputError(f"{where} (question {qid}): no human answers")
        if qid in gold:
            raise ScoringInputError(f"{where}: question {qid} is annotated twice")
        gold[qid] = VQAGold(
            qid,
            answers=tuple(humans),
            answer_type=_optional_str(row, "answer_type", where),
            question_type=_optional_str(row, "question_type", where),
        )
    return gold


def _lxmert_gold(rows: list, path: str | os.PathLike) -> dict[int, VQAGold]:
    gold: dict[int, VQAGold] = {}
    for i, row in enumerate(rows_of(rows, path, "questions")):
        where = f"{path} row {i}"
        qid = required(row, "question_id", int, where)
        if "label" not in row:
            raise ScoringInputError(f"{where} (question {qid}): no 'label' scores: this split is unlabelled")
        label = required(row, "label", dict, where)
        for answer, score in label.items():
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                raise ScoringInputError(f"{where} (question {qid}): label score of {answer!r} is {score!r}")
        if qid in gold:
            raise ScoringInputError(f"{where}: question {qid} appears twice")
        gold[qid] = VQAGold(
            qid,
            label={str(k): float(v) for k, v in label.items()},
            answer_type=_optional_str(row, "answer_type", where),
            question_type=_optional_str(row, "question_type", where),
        )
    return gold


def _optional_str(row: dict, key: str, where: str) -> str | None:
    return required(row, key, str, where) if row.get(key) is not None else None


def _check_questions(
    path: str | os.PathLike, gold: Mapping[int, VQAGold], annotations: str | os.PathLike
) -> None:
    data = load_json(path)
    if not isinstance(data, dict) or "questions" not in data:
        raise ScoringInputError(f"{path}: not the official VQA questions JSON ({{'questions': [...]}})")
    ids = {
        required(q, "question_id", int, f"{path} question {i}")
        for i, q in enumerate(rows_of(data["questions"], path, "questions"))
    }
    if ids != set(gold):
        raise ScoringInputError(
            f"{path} holds {len(ids)} questions and {annotations} annotates {len(gold)}, "
            f"{len(ids ^ set(gold))} ids differ: give the questions and annotations of the same split"
        )


def read_vqa_predictions(path: str | os.PathLike) -> dict[int, str]:
    """Question id -> answer from a result file `[{"question_id": int, "answer": str}, ...]`."""
    predictions: dict[int, str] = {}
    for i, row in enumerate(rows_of(load_json(path), path, "results")):
        where = f"{path} row {i}"
        qid = required(row, "question_id", int, where)
        if qid in predictions:
            raise ScoringInputError(f"{where}: question {qid} is predicted twice")
        predictions[qid] = required(row, "answer", str, f"{where} (question {qid})")
    return predictions


def score_vqa_files(
    predictions: str | os.PathLike,
    gold: str | os.PathLike,
    questions: str | os.PathLike | None = None,
    evaluator: str = DEFAULT_EVALUATOR,
) -> dict:
    """`score_vqa` of a result file against an annotations (or LXMERT) file."""
    return score_vqa(
        read_vqa_predictions(predictions),
        read_vqa_gold(gold, questions),
        source=str(gold),
        evaluator=evaluator,
    )
