"""Matcher and subsample_labels against brute-force loops written from detectron2's definitions."""

from __future__ import annotations

import pytest
import torch
from torchvision.ops import box_iou

from extraction.sampling import IGNORE, Matcher, subsample_labels


def brute_force_match(
    quality: torch.Tensor, thresholds: list[float], labels: list[int], low_quality: bool
) -> tuple[list[float], list[int]]:
    """Per column: its best IoU and its label, one column at a time (ties in the argmax left open)."""
    rows, cols = quality.shape
    q = quality.tolist()
    best, out = [], []
    # thresholds compare in the IoU's precision (float32), as a tensor compared with a Python float does
    cuts = torch.tensor(thresholds, dtype=quality.dtype).tolist()
    for j in range(cols):
        value = max(q[i][j] for i in range(rows))
        band = sum(value >= t for t in cuts)  # the band [t_k, t_k+1) the value falls in
        best.append(value)
        out.append(labels[band])
    if low_quality:
        for i in range(rows):
            row_best = max(q[i])
            for j in range(cols):
                if q[i][j] == row_best:
                    out[j] = 1
    return best, out


def quantised_quality(seed: int, rows: int, cols: int) -> torch.Tensor:
    """IoU-like values on a coarse grid (exact threshold values and many ties among them)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor([0.0, 0.1, 0.29, 0.3, 0.31, 0.5, 0.69, 0.7, 0.71, 0.9, 1.0])
    return grid[torch.randint(len(grid), (rows, cols), generator=gen)]


def random_box_quality(seed: int, rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)

    def boxes(n):
        xy = torch.rand(n, 2, generator=gen) * 80
        wh = torch.rand(n, 2, generator=gen) * 40 + 4
        return torch.cat([xy, xy + wh], dim=1)

    return box_iou(boxes(rows), boxes(cols))


def check_matcher(matcher: Matcher, quality: torch.Tensor, thresholds, labels, low_quality) -> None:
    matches, match_labels = matcher(quality)
    best, expected = brute_force_match(quality, thresholds, labels, low_quality)
    assert matches.dtype == torch.int64 and match_labels.dtype == torch.int8
    assert matches.shape == match_labels.shape == (quality.shape[1],)
    assert match_labels.tolist() == expected
    cols = torch.arange(quality.shape[1])
    # the matched row is a row of the column's highest IoU (ties: any of them)
    assert quality[matches, cols].tolist() == best
    for j in range(quality.shape[1]):
        column = quality[:, j]
        if int((column == column.max()).sum()) == 1:
            assert int(matches[j]) == int(column.argmax())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("make", [quantised_quality, random_box_quality])
def test_rpn_matcher_equals_the_per_column_loop(seed, make):
    thresholds, labels = [0.3, 0.7], [0, -1, 1]
    quality = make(seed, 1 + seed % 4, 40)
    check_matcher(
        Matcher(thresholds, labels, allow_low_quality_matches=True), quality, thresholds, labels, True
    )
    check_matcher(Matcher(thresholds, labels), quality, thresholds, labels, False)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("make", [quantised_quality, random_box_quality])
def test_roi_matcher_equals_the_per_column_loop(seed, make):
    quality = make(100 + seed, 1 + seed % 4, 40)
    check_matcher(Matcher([0.5], [0, 1]), quality, [0.5], [0, 1], False)


def test_low_quality_matches_take_every_tie_of_a_row_best():
    # box 0's best IoU (0.2) is shared by columns 1 and 3; box 1's best (0.6) sits in the ignore band
    quality = torch.tensor(
        [
            [0.1, 0.2, 0.0, 0.2, 0.05],
            [0.0, 0.1, 0.6, 0.6, 0.5],
        ]
    )
    _, labels = Matcher([0.3, 0.7], [0, -1, 1], allow_low_quality_matches=True)(quality)
    assert labels.tolist() == [0, 1, 1, 1, -1]
    _, labels = Matcher([0.3, 0.7], [0, -1, 1])(quality)
    assert labels.tolist() == [0, 0, -1, -1, -1]


def test_thresholds_are_inclusive_below():
    quality = torch.tensor([[0.29999, 0.3, 0.69999, 0.7, 0.5, 0.49999]])
    _, labels = Matcher([0.3, 0.7], [0, -1, 1])(quality)
    assert labels.tolist() == [0, -1, -1, 1, -1, -1]
    _, labels = Matcher([0.5], [0, 1])(quality)
    assert labels.tolist() == [0, 0, 1, 1, 1, 0]


@pytest.mark.parametrize("low_quality", [False, True])
def test_no_ground_truth_gives_every_column_the_lowest_band(low_quality):
    matches, labels = Matcher([0.3, 0.7], [0, -1, 1], allow_low_quality_matches=low_quality)(
        torch.zeros(0, 7)
    )
    assert matches.tolist() == [0] * 7 and labels.tolist() == [0] * 7
    assert matches.dtype == torch.int64 and labels.dtype == torch.int8
    matches, labels = Matcher([0.5], [0, 1])(torch.zeros(0, 0))
    assert matches.shape == labels.shape == (0,)


def test_bad_matcher_arguments_are_refused():
    with pytest.raises(ValueError, match="one label per IoU band"):
        Matcher([0.3, 0.7], [0, 1])
    with pytest.raises(ValueError, match="must increase"):
        Matcher([0.7, 0.3], [0, -1, 1])


def make_labels(num_pos: int, num_neg: int, num_ignore: int, bg: int, seed: int = 0) -> torch.Tensor:
    """Shuffled labels: positives in 0..bg-1 or 1.. (never bg, never -1), negatives = bg, ignored = -1."""
    gen = torch.Generator().manual_seed(seed)
    positive_values = [v for v in range(0, 5) if v != bg]
    pos = torch.tensor(positive_values)[torch.randint(len(positive_values), (num_pos,), generator=gen)]
    labels = torch.cat([pos, torch.full((num_neg,), bg), torch.full((num_ignore,), IGNORE)]).long()
    return labels[torch.randperm(labels.numel(), generator=gen)]


@pytest.mark.parametrize(
    ("num_pos", "num_neg", "num_ignore", "n", "fraction"),
    [
        (200, 5000, 300, 256, 0.5),  # plenty of both: 128 + 128
        (10, 5000, 300, 256, 0.5),  # few positives: negatives fill the rest
        (300, 20, 5, 256, 0.5),  # few negatives: fewer than n in all
        (40, 600, 0, 128, 0.25),  # RoI head: 32 + 96
        (7, 3, 2, 7, 0.5),  # int(3.5) = 3 positives
        (0, 50, 5, 16, 0.25),  # no positives
        (9, 0, 5, 16, 0.25),  # no negatives
        (0, 0, 8, 16, 0.5),  # nothing to draw
        (100, 100, 0, 64, 1.0),
        (100, 100, 0, 64, 0.0),
    ],
)
@pytest.mark.parametrize("bg", [0, 3])
def test_subsample_counts_and_kinds(num_pos, num_neg, num_ignore, n, fraction, bg):
    labels = make_labels(num_pos, num_neg, num_ignore, bg)
    pos, neg = subsample_labels(labels, n, fraction, bg, torch.Generator().manual_seed(1))
    expected_pos = min(int(n * fraction), num_pos)
    assert pos.numel() == expected_pos
    assert neg.numel() == min(n - expected_pos, num_neg)
    assert pos.dtype == neg.dtype == torch.int64
    assert len(set(pos.tolist())) == pos.numel() and len(set(neg.tolist())) == neg.numel()
    assert ((labels[pos] != bg) & (labels[pos] != IGNORE)).all()
    assert (labels[neg] == bg).all()


def test_subsample_is_reproducible_with_a_generator_and_uniform_without_one():
    labels = make_labels(300, 3000, 100, bg=0, seed=5)

    def draw(seed):
        return subsample_labels(labels, 256, 0.5, 0, torch.Generator().manual_seed(seed))

    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])
    # the drawn positives are a uniform sample: every positive gets drawn over many generators
    seen = set()
    for seed in range(40):
        seen.update(draw(seed)[0].tolist())
    positives = set(torch.nonzero(labels > 0).squeeze(1).tolist())
    assert seen == positives
