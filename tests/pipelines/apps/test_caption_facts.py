"""Whether a caption names its generated scene, and the share of captions that do: by hand."""

from __future__ import annotations

import pytest

from pipelines.apps.demo.caption_facts import agreeing_example, caption_agreement, names_scene
from pipelines.apps.demo.synthetic import Scene, Shape, captions, description


def _scene(*shapes: tuple[str, str]) -> Scene:
    """A scene of (colour, shape) shapes; sizes, places and boxes do not matter here."""
    scene = Scene("synth_000000", "test", 128, 128, "white", noisy=False)
    scene.shapes = [Shape(kind, colour, "small", "left", "top", (0, 0, 9, 9)) for colour, kind in shapes]
    return scene


TWO = _scene(("red", "circle"), ("blue", "square"))
THREE = _scene(("red", "circle"), ("blue", "square"), ("red", "circle"))


def test_a_caption_names_its_scene_only_when_every_shape_is_there_as_often_and_none_is_extra() -> None:
    assert names_scene("a red circle and a blue square.", TWO)
    assert names_scene("a blue square and a red circle", TWO)  # order is free
    assert names_scene("a small red circle at the top left and a large blue square.", TWO)  # sizes, places
    assert not names_scene("a red circle.", TWO)  # one shape left out
    assert not names_scene("a red circle, a blue square and a green triangle.", TWO)  # one too many
    assert not names_scene("a red circle and a green square.", TWO)  # wrong colour
    assert not names_scene("a red circle and a blue triangle.", TWO)  # wrong kind
    assert names_scene("two red circles and a blue square.", THREE)
    assert names_scene("a red circle a blue square a red circle", THREE)  # counted, however worded
    assert not names_scene("a red circle and a blue square.", THREE)  # the second red circle is missing
    assert not names_scene("three red circles and a blue square.", THREE)


def test_the_count_and_background_template_names_nothing() -> None:
    assert captions(TWO)[1] == "2 shapes on a plain white background."
    assert not names_scene(captions(TWO)[1], TWO)
    assert names_scene(captions(TWO)[0], TWO) and names_scene(description(TWO), TWO)
    assert description(THREE) == "two red circles and a blue square."


def test_agreement_shares_and_the_example_rule_by_hand() -> None:
    one = _scene(("green", "triangle"))
    other_one = _scene(("yellow", "circle"))
    scenes = {7: TWO, 3: one, 5: other_one, 9: TWO}
    said = {
        7: "a red circle and a blue square.",  # right
        3: "a green triangle.",  # right
        5: "a yellow square.",  # wrong kind
        9: "2 shapes on a plain white background.",  # nothing
    }
    result = caption_agreement(said, scenes)
    assert result == {
        "images": 4,
        "names_every_shape": 50.0,
        "by_shapes": {"1": 50.0, "2": 50.0},
        "images_by_shapes": {"1": 2, "2": 2},
        "names_kinds": 50.0,
        "uses_a_count": 25.0,  # "2 shapes on ...": a number, if not a count of kinds
        "repeated": {"images": 0, "named": None},
        "distinct": {"images": 4, "named": 50.0},
    }
    # the most shapes first, then the lowest id; none when no caption is right
    assert agreeing_example(said, scenes) == 7
    assert agreeing_example({**said, 7: said[9]}, scenes) == 3
    assert agreeing_example({5: said[5], 9: said[9]}, scenes) is None
    with pytest.raises(ValueError, match="not generated scenes"):
        caption_agreement({11: "a red circle"}, scenes)
    with pytest.raises(ValueError, match="no captions"):
        caption_agreement({}, scenes)


def test_what_the_captions_learned_counts_aside_and_how_often_they_count() -> None:
    """A captioner that names colours and kinds but never counts: every scene with a repeated shape is
    wrong, yet its colours and kinds are right; the figures must show both."""
    scenes = {1: THREE, 2: TWO, 3: _scene(("blue", "square"), ("blue", "square"), ("blue", "square"))}
    said = {1: "a red circle and a blue square.", 2: "a red circle and a blue square.", 3: "a blue square."}
    result = caption_agreement(said, scenes)
    assert result["names_every_shape"] == 33.3  # only TWO's caption is right
    assert result["names_kinds"] == 100.0 and result["uses_a_count"] == 0.0
    assert result["repeated"] == {"images": 2, "named": 0.0}
    assert result["distinct"] == {"images": 1, "named": 100.0}
    counted = caption_agreement(
        {**said, 1: "two red circles and a blue square.", 3: "3 blue squares"}, scenes
    )
    assert counted["uses_a_count"] == 66.7 and counted["repeated"] == {"images": 2, "named": 100.0}
