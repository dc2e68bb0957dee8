"""Prompt accuracy: targets parsed from prompts with colours, sizes and counts; an image passes only when the
detector finds every target as often as asked, above the score threshold."""

from __future__ import annotations

from collections import Counter

import pytest

from pipelines.scoring.prompt_accuracy import Detection, prompt_accuracy, prompt_targets, satisfies

SHAPES = ("circle", "square", "triangle")
COLOURS = ("red", "green", "blue", "yellow")


def test_targets_from_prompts():
    assert prompt_targets(
        "a small yellow triangle at the bottom left and a large green circle", SHAPES, COLOURS
    ) == (Counter({("yellow", "triangle"): 1, ("green", "circle"): 1}))
    assert prompt_targets("two red circles and a blue square", SHAPES, COLOURS) == Counter(
        {("red", "circle"): 2, ("blue", "square"): 1}
    )
    assert prompt_targets("a circle", SHAPES, COLOURS) == Counter()  # no colour: nothing checkable


def test_satisfies_needs_every_target_its_count_and_the_threshold():
    wanted = Counter({("red", "circle"): 2, ("blue", "square"): 1})
    two_red = [Detection("circle", "red", 0.9), Detection("circle", "red", 0.8)]
    assert satisfies([*two_red, Detection("square", "blue", 0.7)], wanted)
    assert not satisfies([*two_red, Detection("square", "blue", 0.3)], wanted)  # below threshold
    assert not satisfies([two_red[0], Detection("square", "blue", 0.7)], wanted)  # one circle short
    assert not satisfies([*two_red, Detection("square", "green", 0.9)], wanted)  # wrong colour
    assert not satisfies([Detection("circle", "red", 1.0)], Counter())


def test_accuracy_is_the_fraction_of_passing_images():
    per_image = [
        ("a red circle", [Detection("circle", "red", 0.9)]),
        ("a red circle", [Detection("square", "red", 0.9)]),
        ("a blue square", [Detection("square", "blue", 0.6), Detection("circle", "red", 0.9)]),
        ("a green triangle", []),
    ]
    assert prompt_accuracy(per_image, SHAPES, COLOURS) == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="no generated images"):
        prompt_accuracy([], SHAPES, COLOURS)
