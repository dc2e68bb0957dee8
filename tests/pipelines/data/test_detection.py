"""Detector training data: COCO JSON loading and its counts, resize/flip collation, VG conversion."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from pipelines.data.detection import (
    DetectionCollate,
    DetectionDataset,
    convert_visual_genome,
    load_detection_json,
)
from pipelines.scoring.box_ap import box_ap

MEAN = (102.9801, 115.9465, 122.7717)
STD = (1.0, 1.0, 1.0)


def _image(path: Path, height: int, width: int, seed: int = 0) -> np.ndarray:
    bgr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), bgr)
    return bgr


def _write(tmp_path: Path, annotations: list[dict], **extra) -> Path:
    """Two images (a.png 60x40, b.png 30x30), categories 7 'dog' and 3 'cat', attributes 10 'red', 2 'big'."""
    _image(tmp_path / "img" / "a.png", 40, 60)
    _image(tmp_path / "img" / "b.png", 30, 30, seed=1)
    doc = {
        "images": [
            {"id": 5, "file_name": "a.png", "width": 60, "height": 40},
            {"id": 9, "file_name": "b.png", "width": 30, "height": 30},
        ],
        "annotations": annotations,
        "categories": [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}],
        "attributes": [{"id": 10, "name": "red"}, {"id": 2, "name": "big"}],
        **extra,
    }
    path = tmp_path / "det.json"
    path.write_text(json.dumps(doc))
    return path


def _ann(ann_id: int, bbox: list[float], image_id: int = 5, category_id: int = 7, **extra) -> dict:
    return {
        "id": ann_id,
        "image_id": image_id,
        "bbox": bbox,
        "category_id": category_id,
        "iscrowd": 0,
        **extra,
    }


def test_ids_map_to_contiguous_indices_and_boxes_to_corners(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _ann(1, [10, 5, 20, 15], attribute_ids=[10, 2]),
            _ann(2, [0.5, 1.5, 3, 4], category_id=3),
            _ann(3, [1, 2, 3, 4], image_id=9, attribute_ids=[2]),
        ],
    )
    data = load_detection_json(path, tmp_path / "img")
    assert data.classes == ["cat", "dog"] and data.attributes == ["big", "red"]
    a, b = data.images
    assert (a.image_id, a.file_name, a.path, a.width, a.height) == (
        5,
        "a.png",
        tmp_path / "img" / "a.png",
        60,
        40,
    )
    np.testing.assert_array_equal(a.boxes, np.array([[10, 5, 30, 20], [0.5, 1.5, 3.5, 5.5]], np.float32))
    assert a.boxes.dtype == np.float32 and a.classes.dtype == np.int64 and a.attributes.dtype == np.int64
    assert a.classes.tolist() == [1, 0]
    assert a.attributes.tolist() == [[1, 0], [-1, -1]]
    assert b.attributes.tolist() == [[0]] and b.classes.tolist() == [1]
    assert data.counts == dict.fromkeys(data.counts, 0)


def test_image_without_boxes_has_empty_arrays(tmp_path: Path) -> None:
    data = load_detection_json(_write(tmp_path, [_ann(1, [1, 1, 2, 2])]), tmp_path / "img")
    empty = data.images[1]
    assert empty.boxes.shape == (0, 4) and empty.classes.shape == (0,) and empty.attributes.shape == (0, 1)


def test_bad_annotations_are_clipped_skipped_and_counted(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _ann(1, [-5, 30, 20, 20]),  # left and bottom outside the 60x40 image: clipped
            _ann(2, [50, 0, 20, 10]),  # right edge outside: clipped
            _ann(3, [70, 0, 10, 10]),  # wholly outside: nothing left
            _ann(4, [10, 10, 0, 5]),  # zero width
            _ann(5, [1, 1, 5, 5], category_id=99),
            _ann(6, [1, 1, 5, 5], iscrowd=1),
            _ann(7, [1, 1, 5, 5], attribute_ids=[10, 4, 8]),  # 4 and 8 are unknown: dropped
            _ann(8, [0, 0, 60, 40]),  # exactly the image: not clipped
        ],
    )
    data = load_detection_json(path, tmp_path / "img")
    assert data.counts == {
        "clipped": 2,
        "zero_area": 2,
        "unknown_category": 1,
        "crowd": 1,
        "unknown_attribute": 2,
    }
    np.testing.assert_array_equal(
        data.images[0].boxes, [[0, 30, 15, 40], [50, 0, 60, 10], [1, 1, 6, 6], [0, 0, 60, 40]]
    )
    assert data.images[0].attributes.tolist() == [[-1], [-1], [1], [-1]]


@pytest.mark.parametrize(
    ("annotation", "words"),
    [
        (_ann(41, [-5, 0, 10, 10]), "reaches outside the 60x40 image"),
        (_ann(41, [70, 0, 10, 10]), "has no area"),
        (_ann(41, [1, 1, 5, 5], category_id=99), "category_id 99"),
        (_ann(41, [1, 1, 5, 5], iscrowd=1), "crowd"),
        (_ann(41, [1, 1, 5, 5], attribute_ids=[4]), "attribute id 4"),
    ],
)
def test_strict_turns_each_problem_into_a_one_line_error(
    tmp_path: Path, annotation: dict, words: str
) -> None:
    path = _write(tmp_path, [_ann(1, [1, 1, 5, 5]), annotation])
    load_detection_json(path, tmp_path / "img")  # lenient: loads
    with pytest.raises(ValueError) as info:
        load_detection_json(path, tmp_path / "img", strict=True)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "annotation 41" in message and words in message
    assert "; " in message  # followed by what to do


def test_missing_images_are_counted_and_the_first_named(tmp_path: Path) -> None:
    path = _write(tmp_path, [])
    doc = json.loads(path.read_text())
    doc["images"] += [
        {"id": 11, "file_name": "gone1.png", "width": 5, "height": 5},
        {"id": 12, "file_name": "gone2.png", "width": 5, "height": 5},
    ]
    path.write_text(json.dumps(doc))
    with pytest.raises(
        ValueError, match=r"det\.json: 2 of 4 image files are missing under .*'gone1\.png'"
    ) as info:
        load_detection_json(path, tmp_path / "img")
    assert "\n" not in str(info.value)


def test_malformed_files_name_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{")
    with pytest.raises(ValueError, match=r"broken\.json: not valid JSON"):
        load_detection_json(path, tmp_path)
    path.write_text(json.dumps({"images": [], "annotations": []}))
    with pytest.raises(ValueError, match=r"broken\.json: the file has no 'categories' key"):
        load_detection_json(path, tmp_path)
    good = _write(tmp_path, [{"id": 3, "image_id": 5, "category_id": 7}])
    with pytest.raises(ValueError, match=r"det\.json: annotation 3 has no 'bbox' key"):
        load_detection_json(good, tmp_path / "img")
    good = _write(tmp_path, [_ann(3, [1, 1, 2, 2], image_id=77)])
    with pytest.raises(ValueError, match=r"annotation 3 names image_id 77"):
        load_detection_json(good, tmp_path / "img")
    good = _write(tmp_path, [_ann(3, [1, 1, "2", 2])])
    with pytest.raises(ValueError, match=r"annotation 3 bbox .* is not \[x, y, w, h\]"):
        load_detection_json(good, tmp_path / "img")


def test_coco_gt_scores_its_own_boxes_perfectly(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _ann(1, [-5, 0, 20, 10]),
            _ann(2, [30, 10, 25, 25], category_id=3),
            _ann(3, [2, 3, 4, 5], image_id=9),
        ],
    )
    data = load_detection_json(path, tmp_path / "img")
    gt = data.to_coco_gt()
    assert [c["id"] for c in gt["categories"]] == [1, 2] and [c["name"] for c in gt["categories"]] == [
        "cat",
        "dog",
    ]
    assert [
        (a["image_id"], a["category_id"], a["bbox"], a["area"], a["iscrowd"]) for a in gt["annotations"]
    ] == [
        (5, 2, [0.0, 0.0, 15.0, 10.0], 150.0, 0),
        (5, 1, [30.0, 10.0, 25.0, 25.0], 625.0, 0),
        (9, 2, [2.0, 3.0, 4.0, 5.0], 20.0, 0),
    ]
    assert len({a["id"] for a in gt["annotations"]}) == 3
    detections = [
        {**{k: a[k] for k in ("image_id", "category_id", "bbox")}, "score": 0.9} for a in gt["annotations"]
    ]
    assert box_ap(gt, detections)["AP"] == pytest.approx(1.0)


def test_dataset_items_are_the_decoded_bgr_image_and_the_boxes(tmp_path: Path) -> None:
    path = _write(tmp_path, [_ann(1, [10, 5, 20, 15], attribute_ids=[10])])
    written = cv2.imread(str(tmp_path / "img" / "a.png"))
    dataset = DetectionDataset(load_detection_json(path, tmp_path / "img"))
    assert len(dataset) == 2
    item = dataset[0]
    assert item["index"] == 0 and item["image_id"] == 5 and item["orig_hw"] == (40, 60)
    np.testing.assert_array_equal(item["image"], written)
    np.testing.assert_array_equal(item["boxes"], [[10, 5, 30, 20]])
    assert item["classes"].tolist() == [1] and item["attributes"].tolist() == [[1]]


def test_dataset_refuses_an_image_whose_size_disagrees(tmp_path: Path) -> None:
    path = _write(tmp_path, [])
    _image(tmp_path / "img" / "b.png", 31, 30)
    dataset = DetectionDataset(load_detection_json(path, tmp_path / "img"))
    with pytest.raises(
        ValueError, match=r"b\.png' \(image id 9\) decodes to 30x31 but is annotated as 30x30"
    ):
        dataset[1]


def _item(image: np.ndarray, boxes: list[list[float]], image_id: int = 1) -> dict:
    n = len(boxes)
    return {
        "index": 0,
        "image_id": image_id,
        "image": image,
        "boxes": np.array(boxes, np.float32).reshape(-1, 4),
        "classes": np.arange(n, dtype=np.int64),
        "attributes": np.full((n, 2), -1, np.int64),
        "orig_hw": image.shape[:2],
    }


def test_eval_resize_scales_boxes_by_the_rounded_size() -> None:
    # 33x50 to shortest edge 20: 50 * 20/33 = 30.30 -> 30 wide, so sx = 30/50 and sy = 20/33
    image = np.random.default_rng(0).integers(0, 256, (33, 50, 3), dtype=np.uint8)
    collate = DetectionCollate((20,), 1000, 0.0, MEAN, STD, train=False)
    batch = collate([_item(image, [[5, 3, 45, 30]])])
    assert tuple(batch["images"][0].shape) == (3, 20, 30)
    assert batch["scale"].tolist() == [[pytest.approx(0.6), pytest.approx(20 / 33)]]
    expected = [5 * 0.6, 3 * 20 / 33, 45 * 0.6, 30 * 20 / 33]
    np.testing.assert_allclose(batch["targets"][0]["boxes"].numpy(), [expected], rtol=1e-6)
    assert batch["orig_hw"].tolist() == [[33, 50]] and batch["orig_hw"].dtype == torch.int64


def test_longest_edge_is_capped_at_max_size() -> None:
    # 40x100 at shortest 40 would be 100 wide; max 60 scales both by 0.6 -> 24x60
    image = np.zeros((40, 100, 3), np.uint8)
    batch = DetectionCollate((40,), 60, 0.0, MEAN, STD, train=False)([_item(image, [[10, 10, 50, 30]])])
    assert tuple(batch["images"][0].shape) == (3, 24, 60)
    np.testing.assert_allclose(batch["targets"][0]["boxes"].numpy(), [[6, 6, 30, 18]], rtol=1e-6)


def test_flip_mirrors_pixels_and_boxes() -> None:
    # a white 20x16 block at x 10..30, y 4..20 of a black 40x60 image; halved to 20x30 and mirrored:
    # x1' = 30 - 15 = 15, x2' = 30 - 5 = 25
    image = np.zeros((40, 60, 3), np.uint8)
    image[4:20, 10:30] = 255
    collate = DetectionCollate((20,), 1000, 1.0, MEAN, STD, train=True)
    batch = collate([_item(image, [[10, 4, 30, 20]])], np.random.default_rng(0))
    np.testing.assert_allclose(batch["targets"][0]["boxes"].numpy(), [[15, 2, 25, 10]])
    restored = batch["images"][0].numpy() + np.array(MEAN, np.float32).reshape(3, 1, 1)
    bright = np.argwhere(restored[0] > 200)
    assert (bright[:, 1].min(), bright[:, 0].min(), bright[:, 1].max() + 1, bright[:, 0].max() + 1) == (
        15,
        2,
        25,
        10,
    )


def test_images_are_normalised_bgr_and_not_padded() -> None:
    big = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    tall = np.random.default_rng(2).integers(0, 256, (30, 20, 3), dtype=np.uint8)
    collate = DetectionCollate((20,), 1000, 0.0, MEAN, (2.0, 4.0, 8.0), train=False)
    batch = collate([_item(big, [[1, 1, 5, 5]], image_id=3), _item(tall, [], image_id=4)])
    assert [tuple(im.shape) for im in batch["images"]] == [(3, 20, 30), (3, 30, 20)]
    assert all(im.dtype == torch.float32 for im in batch["images"])
    expected = (big.astype(np.float32) - np.array(MEAN, np.float32)) / np.array([2.0, 4.0, 8.0], np.float32)
    np.testing.assert_allclose(batch["images"][0].numpy(), expected.transpose(2, 0, 1), rtol=1e-6)
    assert batch["image_ids"].tolist() == [3, 4] and batch["image_ids"].dtype == torch.int64
    assert batch["scale"].dtype == torch.float32 and batch["scale"].shape == (2, 2)
    empty = batch["targets"][1]
    assert empty["boxes"].shape == (0, 4) and empty["classes"].dtype == torch.int64
    assert (
        batch["targets"][0]["attributes"].shape == (1, 2)
        and batch["targets"][0]["boxes"].dtype == torch.float32
    )


def test_training_draws_size_then_flip_per_image_from_the_rng() -> None:
    image = np.zeros((40, 60, 3), np.uint8)
    collate = DetectionCollate((10, 20, 30), 1000, 0.5, MEAN, STD, train=True)
    items = [_item(image, [[10, 4, 30, 20]]) for _ in range(40)]
    batch = pickle.loads(pickle.dumps(collate))(items, np.random.default_rng(5))
    mirror = np.random.default_rng(5)
    sizes, flips = [], []
    for _ in items:
        sizes.append((10, 20, 30)[int(mirror.integers(3))])
        flips.append(bool(mirror.random() < 0.5))
    assert [im.shape[1] for im in batch["images"]] == sizes
    assert set(sizes) == {10, 20, 30} and 0 < sum(flips) < len(flips)
    for target, size, flip in zip(batch["targets"], sizes, flips, strict=True):
        s = size / 40
        x1, x2 = (60 * s - 30 * s, 60 * s - 10 * s) if flip else (10 * s, 30 * s)
        np.testing.assert_allclose(target["boxes"].numpy(), [[x1, 4 * s, x2, 20 * s]], rtol=1e-6)


def test_collate_refuses_eval_settings_that_would_augment() -> None:
    with pytest.raises(ValueError, match="one min size"):
        DetectionCollate((10, 20), 1000, 0.0, MEAN, STD, train=False)
    with pytest.raises(ValueError, match="flip_prob 0"):
        DetectionCollate((10,), 1000, 0.5, MEAN, STD, train=False)
    with pytest.raises(ValueError, match="needs an rng"):
        DetectionCollate((10,), 1000, 0.5, MEAN, STD)([_item(np.zeros((8, 8, 3), np.uint8), [])])


def _vg_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "objects_vocab": "dog\ncat,kitty\ntennis racket,tennis racquet\n",
        "attributes_vocab": "white\ngray,grey\nblack and white\nfurry\n",
    }
    paths = {name: tmp_path / f"{name}.txt" for name in files}
    for name, text in files.items():
        paths[name].write_text(text)
    objects = [
        {
            "image_id": 1,
            "objects": [
                {"object_id": 11, "x": 5, "y": 6, "w": 20, "h": 10, "names": ["White Dog."], "synsets": []},
                {"object_id": 12, "x": 0, "y": 0, "w": 8, "h": 8, "names": ["Kitty "], "synsets": []},
                {"object_id": 13, "x": 0, "y": 0, "w": 8, "h": 8, "names": ["big dog"], "synsets": []},
                {
                    "object_id": 14,
                    "x": 90,
                    "y": 1,
                    "w": 30,
                    "h": 5,
                    "names": ["tennis racquet"],
                    "synsets": [],
                },
            ],
        },
        {"image_id": 2, "objects": [{"object_id": 21, "x": 0, "y": 0, "w": 4, "h": 4, "names": ["car"]}]},
    ]
    attributes = [
        {
            "image_id": 1,
            "attributes": [
                {"object_id": 11, "x": 5, "y": 6, "w": 20, "h": 10, "names": ["white dog"]},
                {
                    "object_id": 12,
                    "x": 0,
                    "y": 0,
                    "w": 8,
                    "h": 8,
                    "names": ["kitty"],
                    "attributes": ["Grey and furry", "black and white", "shiny"],
                },
            ],
        },
        {"image_id": 2, "attributes": []},
    ]
    image_data = [
        {
            "image_id": 1,
            "width": 100,
            "height": 50,
            "url": "x/VG_100K/1.jpg",
            "coco_id": None,
            "flickr_id": 3,
        },
        {"image_id": 2, "width": 40, "height": 40, "url": "x/VG_100K/2.jpg", "coco_id": 7, "flickr_id": None},
    ]
    for name, doc in (("objects", objects), ("attributes", attributes), ("image_data", image_data)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    return paths


def test_visual_genome_converts_to_coco_with_attributes(tmp_path: Path) -> None:
    vg = _vg_files(tmp_path)
    out = tmp_path / "out" / "vg_train.json"
    counts = convert_visual_genome(
        vg["objects"],
        vg["attributes"],
        vg["image_data"],
        vg["objects_vocab"],
        vg["attributes_vocab"],
        out,
        "VG_100K",
    )
    # "big dog" (big is not a common adjective) and "car" are not in the vocab; "shiny" is no attribute
    assert counts == {
        "images": 1,
        "annotations": 3,
        "unknown_object": 2,
        "unknown_attribute": 1,
        "images_without_objects": 1,
        "clipped_box": 1,  # the racket reaches x = 120 in a 100-wide image
        "box_without_area": 0,
    }
    doc = json.loads(out.read_text())
    assert doc["images"] == [{"id": 1, "file_name": "VG_100K/1.jpg", "width": 100, "height": 50}]
    assert doc["categories"] == [
        {"id": 1, "name": "dog"},
        {"id": 2, "name": "cat"},
        {"id": 3, "name": "tennis racket"},
    ]
    assert [a["name"] for a in doc["attributes"]] == ["white", "gray", "black and white", "furry"]
    rows = [(a["vg_object_id"], a["category_id"], a["bbox"], a["attribute_ids"]) for a in doc["annotations"]]
    assert rows == [
        (11, 1, [5, 6, 20, 10], [1]),  # "White Dog." -> dog + white
        (12, 2, [0, 0, 8, 8], [2, 4, 3]),  # kitty -> cat; grey -> gray, furry, black and white
        (14, 3, [90, 1, 10, 5], []),
    ]

    _image(tmp_path / "images" / "VG_100K" / "1.jpg", 50, 100)
    data = load_detection_json(out, tmp_path / "images")
    assert data.classes == ["dog", "cat", "tennis racket"]
    assert data.counts["clipped"] == 0  # clipped by the conversion already
    np.testing.assert_array_equal(data.images[0].boxes[2], [90, 1, 100, 6])
    assert data.images[0].attributes.tolist() == [[0, -1, -1], [1, 3, 2], [-1, -1, -1]]


def test_visual_genome_needs_every_image_in_image_data(tmp_path: Path) -> None:
    vg = _vg_files(tmp_path)
    vg["image_data"].write_text(json.dumps([{"image_id": 1, "width": 100, "height": 50}]))
    with pytest.raises(ValueError, match=r"objects\.json: image 2 is not in .*image_data\.json"):
        convert_visual_genome(
            vg["objects"],
            vg["attributes"],
            vg["image_data"],
            vg["objects_vocab"],
            vg["attributes_vocab"],
            tmp_path / "out.json",
        )


def _convert(vg: dict[str, Path], out: Path) -> dict[str, int]:
    names = ("objects", "attributes", "image_data", "objects_vocab", "attributes_vocab")
    return convert_visual_genome(*(vg[name] for name in names), out)


def test_visual_genome_boxes_without_area_are_skipped_and_those_outside_clipped(tmp_path: Path) -> None:
    vg = _vg_files(tmp_path)
    doc = json.loads(vg["objects"].read_text())
    boxes = {  # object id -> (x, y, w, h), in the 100x50 image 1; None: skipped
        11: ((5, 6, -10, 10), None),
        12: ((5, 6, 1e300, 10), [5, 6, 95, 10]),
        14: ((5000, 6000, 20, 20), None),  # far outside the image
        15: ((-30, -40, 50, 50), [0, 0, 20, 10]),
        16: ((1, 1, 3, 0), None),
    }
    extra = [{"object_id": i, "names": ["dog"], "synsets": []} for i in (15, 16)]
    doc[0]["objects"] = [o for o in doc[0]["objects"] if o["object_id"] != 13] + extra
    for obj in doc[0]["objects"]:
        obj.update(zip("xywh", boxes[obj["object_id"]][0], strict=True))
    vg["objects"].write_text(json.dumps(doc))
    counts = _convert(vg, tmp_path / "out.json")
    assert (counts["annotations"], counts["box_without_area"], counts["clipped_box"]) == (2, 3, 2)
    got = {
        a["vg_object_id"]: a["bbox"] for a in json.loads((tmp_path / "out.json").read_text())["annotations"]
    }
    assert got == {i: want for i, (_, want) in boxes.items() if want is not None}


def test_visual_genome_refuses_two_image_data_rows_for_one_image(tmp_path: Path) -> None:
    vg = _vg_files(tmp_path)
    rows = json.loads(vg["image_data"].read_text())
    vg["image_data"].write_text(json.dumps([*rows, {**rows[0], "width": 999}]))
    with pytest.raises(ValueError, match=r"image_data\.json: rows 0 and 2 both describe image 1; keep one"):
        _convert(vg, tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()


def _escape(tmp_path: Path) -> Path:
    path = _write(tmp_path, [_ann(1, [1, 2, 3, 4])])
    doc = json.loads(path.read_text())
    doc["images"][1]["file_name"] = "/etc/passwd"
    path.write_text(json.dumps(doc))
    return path


def _dotdot(tmp_path: Path) -> Path:
    path = _write(tmp_path, [_ann(1, [1, 2, 3, 4])])
    doc = json.loads(path.read_text())
    doc["images"][0]["file_name"] = "../det.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    "make, needle",
    [
        (_escape, "image 9 file_name '/etc/passwd' leaves the images folder"),
        (_dotdot, "image 5 file_name '../det.json' leaves the images folder"),
        (lambda tmp_path: _write(tmp_path, [], categories=[]), "'categories' is empty"),
        (
            lambda tmp_path: _write(tmp_path, [_ann(i, [1, 2, 3, 4]) for i in range(2001)]),
            "image 5 has more than 2000 boxes (annotation 2000",
        ),
    ],
)
def test_hostile_detection_files_are_one_line(make, needle: str, tmp_path: Path) -> None:
    """Issue 46: paths outside --images, no categories, more boxes on one image than any real one."""
    with pytest.raises(ValueError) as err:
        load_detection_json(make(tmp_path), tmp_path / "img")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_million_boxes_on_one_image_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A 50k-annotation image (a 10^6 one reached 15 GB in training): refused while loading, with the peak
    that of parsing the file (VmHWM < 1.2 GB, torch included)."""
    many = ",".join(
        f'{{"id": {i}, "image_id": 5, "bbox": [1, 2, 3, 4], "category_id": 7}}' for i in range(50_000)
    )
    path = _write(tmp_path, [])
    path.write_text(path.read_text().replace('"annotations": []', f'"annotations": [{many}]'))
    script = f"""
        from pipelines.data.detection import load_detection_json
        try:
            load_detection_json({str(path)!r}, {str(tmp_path / "img")!r})
            print("loaded")
        except ValueError as exc:
            print("refused", "more than 2000 boxes" in str(exc))
        print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) >> 10)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcome, peak_mb = proc.stdout.splitlines()
    assert outcome == "refused True" and int(peak_mb) < 1200, proc.stdout


@pytest.mark.timeout(120)  # a FIFO read used to hang
def test_visual_genome_conversion_refuses_fifos_devices_and_non_finite_boxes(tmp_path: Path) -> None:
    """Issue 46: a FIFO or /dev/zero as a vocab, a FIFO as --out: one line, no hang; NaN boxes and
    non-positive sizes are named, never written (NaN is not JSON); random bytes as a vocab name the file."""
    vg = _vg_files(tmp_path)
    os.mkfifo(tmp_path / "fifo")

    def convert(**change) -> str:
        args = {**vg, "out": tmp_path / "out.json", **change}
        with pytest.raises((ValueError, OSError)) as err:
            convert_visual_genome(
                args["objects"],
                args["attributes"],
                args["image_data"],
                args["objects_vocab"],
                args["attributes_vocab"],
                args["out"],
            )
        return str(err.value)

    assert "not a regular file" in convert(objects_vocab=tmp_path / "fifo")
    assert "not a regular file" in convert(attributes_vocab=Path("/dev/zero"))
    assert "fifo exists and is not a regular file" in convert(out=tmp_path / "fifo")
    (tmp_path / "noise.txt").write_bytes(bytes(range(128, 256)) * 4)
    assert "noise.txt" in convert(objects_vocab=tmp_path / "noise.txt")
    objects = json.loads(vg["objects"].read_text())
    objects[0]["objects"][0]["w"] = float("nan")
    vg["objects"].write_text(json.dumps(objects))
    assert "holds a non-finite number" in convert()
    vg["image_data"].write_text(json.dumps([{"image_id": 1, "width": -5, "height": 50}]))
    assert "image 1 is -5x50" in convert()
    assert not (tmp_path / "out.json").exists()


def test_training_on_only_unknown_or_crowd_boxes_is_refused(tmp_path: Path) -> None:
    """Issue 46: every box skipped (unknown category, crowd) used to train on empty images, exit 0."""
    from pipelines.tasks.detection import DetectionTask, DetectorTaskConfig

    path = _write(tmp_path, [_ann(1, [1, 2, 3, 4], category_id=99), _ann(2, [1, 2, 3, 4], iscrowd=1)])
    with pytest.raises(
        ValueError, match=r"no image has a usable box \(skipped: unknown_category 1, crowd 1\)"
    ):
        DetectionTask(DetectorTaskConfig(images=str(tmp_path / "img"), annotations=str(path)))


def test_bad_annotations_are_one_warning_naming_the_flag(tmp_path: Path, caplog) -> None:
    """Issue 45: `detector train` said it four times (loader and task, train and the same file as --valid)
    and named `strict=True`; once per file, naming --strict."""
    from pipelines.tasks.detection import DetectionTask, DetectorTaskConfig

    path = _write(tmp_path, [_ann(1, [1, 2, 3, 4]), _ann(2, [1, 2, 3, 4], category_id=99)])
    cfg = DetectorTaskConfig(images=str(tmp_path / "img"), annotations=str(path), valid=str(path))
    with caplog.at_level("WARNING"):
        DetectionTask(dataclasses.replace(cfg, preset="c4-small"))
    said = [r.getMessage() for r in caplog.records if "unknown category" in r.getMessage()]
    assert len(said) == 1 and "--strict" in said[0] and "strict=True" not in said[0], said


def test_the_release_schedule_on_a_cpu_is_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    """Issue 45: the default vg-r101-c4 preset's 90k steps on a CPU are said before they start."""
    import pipelines.tasks.detection as detection
    from pipelines.cli import main

    monkeypatch.setattr(detection, "train_detector", lambda cfg, out, resume: {"step": 0})
    argv = ["detector", "train", "--images", "img", "--annotations", "det.json", "--out", str(tmp_path / "r")]
    with caplog.at_level("WARNING"):
        assert main([*argv, "train.device=cpu"]) == 0
        assert main([*argv, "train.device=cpu", "--preset", "c4-small"]) == 0
    said = [r.getMessage() for r in caplog.records if "on the CPU" in r.getMessage()]
    assert len(said) == 1 and "90000 steps of 16 images" in said[0] and "--preset c4-small" in said[0], said
