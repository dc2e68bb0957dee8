"""DALL-Eval-style prompt accuracy: does a detector find, in a generated image, every (colour, shape) the
prompt names, as many times as it says? Detections are (shape, colour, score) from any trained detector."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

NUMBER_WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}


@dataclass(frozen=True)
class Detection:
    shape: str
    colour: str
    score: float


def prompt_targets(prompt: str, shapes: Sequence[str], colours: Sequence[str]) -> Counter:
    """The (colour, shape) objects a prompt asks for, with counts: "two red circles and a blue square" ->
    {(red, circle): 2, (blue, square): 1}. Words between the colour and the shape (sizes) are allowed."""
    words = re.findall(r"[a-z0-9]+", prompt.lower())
    singular = {s: s for s in shapes} | {s + "s": s for s in shapes}
    wanted: Counter = Counter()
    for i, word in enumerate(words):
        if word not in singular:
            continue
        # the nearest colour before the shape, not past the previous shape
        colour, count = None, 1
        for j in range(i - 1, max(-1, i - 4), -1):
            if words[j] in singular:
                break
            if colour is None and words[j] in colours:
                colour = words[j]
            elif words[j] in NUMBER_WORDS or words[j].isdigit():
                count = NUMBER_WORDS.get(words[j]) or int(words[j])
                break
        if colour is not None:
            wanted[(colour, singular[word])] += count
    return wanted


def satisfies(detections: Sequence[Detection], wanted: Counter, threshold: float = 0.5) -> bool:
    """True when the detections at or above `threshold` hold each wanted (colour, shape) at least as often
    as asked; a prompt naming nothing checkable is never satisfied (it cannot be scored as a success)."""
    if not wanted:
        return False
    found = Counter((d.colour, d.shape) for d in detections if d.score >= threshold)
    return all(found[key] >= n for key, n in wanted.items())


def prompt_accuracy(
    per_image: Sequence[tuple[str, Sequence[Detection]]],
    shapes: Sequence[str],
    colours: Sequence[str],
    threshold: float = 0.5,
) -> float:
    """The fraction of (prompt, detections of one generated image) pairs whose prompt is satisfied."""
    if not per_image:
        raise ValueError("no generated images to score")
    hits = [satisfies(d, prompt_targets(p, shapes, colours), threshold) for p, d in per_image]
    return sum(hits) / len(hits)
