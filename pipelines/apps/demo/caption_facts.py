"""Whether a caption names what a generated scene holds: every shape's colour and kind, as many times as
the scene has it, and no other; and the share of scenes whose caption does (a figure CIDEr-D cannot hide)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from pipelines.apps.demo.synthetic import COLOURS, NUMBER_WORDS, SHAPES, Scene
from pipelines.scoring.prompt_accuracy import prompt_targets


def names_scene(caption: str, scene: Scene) -> bool:
    """True when `caption` names each (colour, shape) of the scene as often as it occurs ("two red circles"
    counts two) and nothing the scene lacks; the words are read as DALL-E's prompt accuracy reads them."""
    held = Counter((s.colour, s.shape) for s in scene.shapes)
    return prompt_targets(caption, SHAPES, list(COLOURS)) == held


def caption_agreement(captions: Mapping[int, str], scenes: Mapping[int, Scene]) -> dict:
    """Over the scenes `captions` covers: how many, the share (%) whose caption names them (`names_scene`),
    and that share and the number of scenes by the scene's number of shapes."""
    if not captions:
        raise ValueError("no captions to check")
    missing = [k for k in captions if k not in scenes]
    if missing:
        raise ValueError(f"{len(missing)} captioned images are not generated scenes, e.g. {missing[:3]}")
    named = {k: names_scene(c, scenes[k]) for k, c in captions.items()}
    by_count: dict[int, list[bool]] = {}
    for k, ok in named.items():
        by_count.setdefault(len(scenes[k].shapes), []).append(ok)
    repeated = [k for k in captions if _repeats(scenes[k])]
    distinct = [k for k in captions if not _repeats(scenes[k])]
    counting = set(NUMBER_WORDS[1:]) | {str(n) for n in range(2, 10)}
    return {
        "images": len(captions),
        "names_every_shape": _share(list(named.values())),
        # str keys, as summary.json keeps them
        "by_shapes": {str(n): _share(v) for n, v in sorted(by_count.items())},
        "images_by_shapes": {str(n): len(v) for n, v in sorted(by_count.items())},
        # what the captions get right leaving the counts aside: each (colour, shape) named, none extra
        "names_kinds": _share([_kinds(c) == _kinds_held(scenes[k]) for k, c in captions.items()]),
        # how often a caption counts at all ("two red circles"), and the scenes that need it
        "uses_a_count": _share([bool(counting & set(_words(c))) for c in captions.values()]),
        "repeated": {
            "images": len(repeated),
            "named": _share([named[k] for k in repeated]) if repeated else None,
        },
        "distinct": {
            "images": len(distinct),
            "named": _share([named[k] for k in distinct]) if distinct else None,
        },
    }


def _repeats(scene: Scene) -> bool:
    """Whether the scene holds some (colour, shape) more than once (its description counts)."""
    return len({(s.colour, s.shape) for s in scene.shapes}) < len(scene.shapes)


def _words(caption: str) -> list[str]:
    return caption.lower().replace(",", " ").replace(".", " ").split()


def _kinds(caption: str) -> set:
    return set(prompt_targets(caption, SHAPES, list(COLOURS)))


def _kinds_held(scene: Scene) -> set:
    return {(s.colour, s.shape) for s in scene.shapes}


def _share(hits: list[bool]) -> float:
    return round(100 * sum(hits) / len(hits), 1)


def agreeing_example(captions: Mapping[int, str], scenes: Mapping[int, Scene]) -> int | None:
    """The captioned scene to show: of those whose caption names the scene, the one with the most shapes
    (the lowest id among ties); None when no caption does."""
    agreeing = [k for k, c in captions.items() if names_scene(c, scenes[k])]
    return min(agreeing, key=lambda k: (-len(scenes[k].shapes), k), default=None)
