"""Caption-to-image retrieval recall: R@k from each caption's rank of its own image, whether the ranks
come from a model's scores of every pair (validation) or from a rankings file (`xmodal score`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from pipelines.scoring.inputs import ScoringInputError, load_json, missing_error, required, rows_of

RECALL_AT = (1, 5, 10)


def recall_from_ranks(ranks: Mapping[str, int | None], ks: Sequence[int] = RECALL_AT) -> dict[str, float]:
    """`R@k` in %: the share of captions whose own image has rank <= k (1 = best; None = below every k)."""
    if not ranks:
        raise ValueError("no captions to score")
    return {f"R@{k}": 100.0 * sum(r is not None and r <= k for r in ranks.values()) / len(ranks) for k in ks}


def read_rankings(path: str | os.PathLike) -> dict[str, list[str]]:
    """Caption id -> image ids best first, from `[{"caption_id": str, "images": [str, ...]}, ...]`
    (what `xmodal evaluate retrieval` writes)."""
    rankings: dict[str, list[str]] = {}
    for i, row in enumerate(rows_of(load_json(path), path, "rankings")):
        where = f"{path} row {i}"
        caption = required(row, "caption_id", str, where)
        images = required(row, "images", list, f"{where} (caption {caption!r})")
        if not all(isinstance(img, str) for img in images):
            raise ScoringInputError(f"{where} (caption {caption!r}): 'images' must be a list of image ids")
        if len(set(images)) != len(images):
            raise ScoringInputError(f"{where} (caption {caption!r}): an image is ranked twice")
        if caption in rankings:
            raise ScoringInputError(f"{where}: caption {caption!r} is ranked twice")
        rankings[caption] = images
    return rankings


def ranks_of_rankings(
    rankings: Mapping[str, Sequence[str]],
    own_image: Mapping[str, str],
    gallery: int,
    ks: Sequence[int] = RECALL_AT,
    source: str | None = None,
) -> dict[str, int | None]:
    """Each gold caption's rank of its own image (`own_image`: caption -> image) in its ranking; a ranking
    must list its own image or at least min(max k, `gallery`) images, or the recall would be a guess."""
    missing = [c for c in own_image if c not in rankings]
    if missing:
        raise missing_error("captions", missing, source)
    extra = [c for c in rankings if c not in own_image]
    if extra:
        raise ScoringInputError(
            f"{len(extra)} ranked captions are not in {source or 'the gold set'} (e.g. {extra[0]!r}): "
            "score against the captions of the split that was ranked"
        )
    needed = min(max(ks), gallery)
    ranks: dict[str, int | None] = {}
    for caption, image in own_image.items():
        ranked = list(rankings[caption])
        if image in ranked:
            ranks[caption] = ranked.index(image) + 1
        elif len(ranked) < needed:
            raise ScoringInputError(
                f"caption {caption!r} ranks {len(ranked)} images without its own: R@{max(ks)} needs its "
                f"{needed} best images (rank every image of the split)"
            )
        else:
            ranks[caption] = None
    return ranks
