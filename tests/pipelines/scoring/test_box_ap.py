"""Box AP through pycocotools against hand-computed values, attribute accuracy, the table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines.scoring.box_ap import attribute_accuracy, box_ap, format_table


def _gt(boxes: list[tuple[int, int, list[float]]]) -> dict:
    """(image id, category id, [x, y, w, h]) per ground-truth box, images 1 and 2 of 400x400."""
    return {
        "images": [{"id": i, "file_name": f"{i}.jpg", "width": 400, "height": 400} for i in (1, 2)],
        "annotations": [
            {"id": n + 1, "image_id": im, "category_id": c, "bbox": b, "area": b[2] * b[3], "iscrowd": 0}
            for n, (im, c, b) in enumerate(boxes)
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
    }


def _det(image_id: int, category_id: int, bbox: list[float], score: float) -> dict:
    return {"image_id": image_id, "category_id": category_id, "bbox": bbox, "score": score}


# one box per area range: small (< 32^2), medium, large (> 96^2)
BOXES = [
    (1, 1, [10.0, 10.0, 20.0, 20.0]),
    (1, 2, [100.0, 100.0, 50.0, 50.0]),
    (2, 1, [0.0, 0.0, 120.0, 120.0]),
]


def test_perfect_detections_score_one_everywhere(capsys) -> None:
    gt = _gt(BOXES)
    metrics = box_ap(gt, [_det(im, c, b, 0.9) for im, c, b in BOXES])
    assert list(metrics) == ["AP", "AP50", "AP75", "APs", "APm", "APl"]
    assert metrics == {k: pytest.approx(1.0) for k in metrics}
    assert capsys.readouterr().out == ""  # pycocotools' printing is swallowed
    assert "ignore" not in gt["annotations"][0]  # the caller's dict is left as it was


def test_iou_of_0_61_passes_at_50_and_fails_at_75() -> None:
    # shifted 24 px: IoU = 76 * 100 / (124 * 100) = 0.613, a match at IoU 0.50, 0.55, 0.60 only
    metrics = box_ap(_gt([(1, 1, [0.0, 0.0, 100.0, 100.0])]), [_det(1, 1, [24.0, 0.0, 100.0, 100.0], 0.9)])
    assert metrics["AP50"] == pytest.approx(1.0)
    assert metrics["AP75"] == pytest.approx(0.0)
    assert metrics["AP"] == pytest.approx(3 / 10)


def test_a_higher_scored_false_positive_lowers_ap_as_by_hand() -> None:
    # ranked: hit A (P 1, R 0.5), miss (P 0.5, R 0.5), hit B (P 2/3, R 1); COCO's interpolated precision
    # is 1 at the 51 recall points 0.00..0.50 and 2/3 at the 50 points 0.51..1.00
    gt = _gt([(1, 1, [0.0, 0.0, 100.0, 100.0]), (1, 1, [200.0, 200.0, 100.0, 100.0])])
    detections = [
        _det(1, 1, [0.0, 0.0, 100.0, 100.0], 0.9),
        _det(1, 1, [100.0, 250.0, 60.0, 60.0], 0.8),
        _det(1, 1, [200.0, 200.0, 100.0, 100.0], 0.7),
    ]
    expected = (51 * 1.0 + 50 * 2 / 3) / 101
    metrics = box_ap(gt, detections)
    assert metrics["AP50"] == pytest.approx(expected) and metrics["AP"] == pytest.approx(expected)
    # the false positive ranked first: precision 1/2 at every recall point
    detections[1]["score"] = 0.95
    only = box_ap(_gt([(1, 1, [0.0, 0.0, 100.0, 100.0])]), detections[:2])
    assert only["AP50"] == pytest.approx(0.5)


def test_wrong_category_is_a_miss() -> None:
    metrics = box_ap(_gt([(1, 1, [0.0, 0.0, 100.0, 100.0])]), [_det(1, 2, [0.0, 0.0, 100.0, 100.0], 0.9)])
    assert metrics["AP"] == 0.0


def test_no_detections_score_zero_and_empty_area_ranges_are_nan() -> None:
    assert box_ap(_gt(BOXES), []) == dict.fromkeys(["AP", "AP50", "AP75", "APs", "APm", "APl"], 0.0)
    medium_only = box_ap(_gt([(1, 1, [0.0, 0.0, 50.0, 50.0])]), [_det(1, 1, [0.0, 0.0, 50.0, 50.0], 1.0)])
    assert medium_only["APm"] == pytest.approx(1.0)
    assert math.isnan(medium_only["APs"]) and math.isnan(medium_only["APl"])


def test_detections_outside_the_ground_truth_are_refused() -> None:
    with pytest.raises(ValueError, match="image_id 9"):
        box_ap(_gt(BOXES), [_det(9, 1, [0, 0, 5, 5], 1.0)])
    with pytest.raises(ValueError, match="category_id 3"):
        box_ap(_gt(BOXES), [_det(1, 3, [0, 0, 5, 5], 1.0)])


def test_attribute_accuracy_counts_boxes_with_gold_only() -> None:
    gold = [np.array([1, -1]), np.array([0, 1]), np.array([-1, -1]), np.array([3]), np.array([], np.int64)]
    # box 0 right, box 1 wrong, box 2 and 4 have no gold attribute, box 3 right: 2 of 3
    assert attribute_accuracy(np.array([1, 2, 0, 3, 5]), gold) == pytest.approx(2 / 3)
    assert math.isnan(attribute_accuracy(np.array([0]), [np.array([-1])]))
    with pytest.raises(ValueError, match="2 predicted attributes for 1"):
        attribute_accuracy(np.array([0, 1]), [np.array([0])])


def test_format_table_shows_percentages_and_dashes() -> None:
    table = format_table({"AP": 0.5, "AP50": 1.0, "APl": math.nan, "attr_acc": 0.25})
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "value"]
    assert [line.split() for line in lines[1:]] == [
        ["AP", "50.00"],
        ["AP50", "100.00"],
        ["APl", "-"],
        ["attr_acc", "25.00"],
    ]
