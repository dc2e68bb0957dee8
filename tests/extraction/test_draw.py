"""Region drawing (legible sizes, labels that never overlap), VG vocabulary loading and `xmodal features
show`."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from extraction.draw import (
    MAX_SIDE,
    MIN_SIDE,
    draw_regions,
    layout_labels,
    load_vg_vocab,
    overlaps,
    picture_scale,
    region_label,
)
from storage import RegionFeatures

# shorter side below, at and above MIN_SIDE, beyond MAX_SIDE, and long thin images either way
SIZES = [(30, 40), (60, 80), (96, 96), (480, 640), (900, 1200), (3000, 4000), (100, 2000), (2000, 100)]


def record(img_id: str = "img1", h: int = 60, w: int = 80, dim: int = 8) -> RegionFeatures:
    return RegionFeatures(
        img_id=img_id,
        img_h=h,
        img_w=w,
        boxes=np.array([[5, 30, 30, 55], [40, 25, 75, 50]], np.float32),
        features=np.ones((2, dim), np.float32),
        objects_id=np.array([1, 2], np.int64),
        objects_conf=np.array([0.9, 0.5], np.float32),
        attrs_id=np.array([0, 1], np.int64),
        attrs_conf=np.array([0.3, 0.2], np.float32),
    )


@pytest.fixture()
def vocab_dir(tmp_path):
    (tmp_path / "objects_vocab.txt").write_text("cat,kitty\ndog\nbird,birdie\n")
    (tmp_path / "attributes_vocab.txt").write_text("black,dark\nfluffy\n")
    return tmp_path


def test_vocab_first_synonym_is_the_name(vocab_dir):
    objects, attributes = load_vg_vocab(vocab_dir)
    assert objects == ["cat", "dog", "bird"] and attributes == ["black", "fluffy"]


def test_vocab_with_vg_file_names(tmp_path):
    (tmp_path / "vg_objects_vocab.txt").write_text("tree\n")
    (tmp_path / "vg_attributes_vocab.txt").write_text("green,leafy\n")
    assert load_vg_vocab(tmp_path) == (["tree"], ["green"])
    with pytest.raises(FileNotFoundError, match="objects_vocab.txt"):
        load_vg_vocab(tmp_path / "missing")


def test_shared_vg_vocabularies(shared_reference):
    objects, attributes = load_vg_vocab(shared_reference)
    assert len(objects) == 1600 and len(attributes) == 400
    assert all(name and "," not in name for name in objects + attributes)


def test_labels_with_and_without_vocab(vocab_dir):
    rec = record()
    objects, attributes = load_vg_vocab(vocab_dir)
    assert region_label(rec, 0, objects, attributes) == "black dog"
    assert region_label(rec, 1, objects, attributes) == "fluffy bird"
    assert region_label(rec, 1) == "attr1 obj2"


def test_draw_marks_boxes_and_leaves_the_rest():
    image = np.full((60, 80, 3), 127, np.uint8)
    drawing = draw_regions(image, record())
    k = MIN_SIDE / 60  # enlarged to a 600 px shorter side
    drawn = drawing.image
    assert drawn.shape == (600, 800, 3) and drawn.dtype == np.uint8
    assert np.array_equal(image, np.full((60, 80, 3), 127, np.uint8))  # input untouched
    changed = np.any(drawn != 127, axis=2)
    assert changed[round(55 * k) - 1, round(5 * k) : round(30 * k)].all()  # the first box's bottom edge
    labelled = np.zeros_like(changed)
    for label in drawing.labels:
        x1, y1, x2, y2 = label.box
        labelled[y1:y2, x1:x2] = True
    boxes = np.zeros_like(changed)
    for x1, y1, x2, y2 in record().boxes * k:
        boxes[round(y1) - 2 : round(y2) + 2, round(x1) - 2 : round(x2) + 2] = True
    assert not (changed & ~labelled & ~boxes).any(), "only boxes and labels are drawn"
    assert [label.region for label in drawing.labels] == [0, 1]
    assert [label.text for label in drawing.labels] == ["attr0 obj1", "attr1 obj2"]


def test_picture_scale_enlarges_small_and_reduces_large_images():
    assert picture_scale(60, 80) == 10.0 and picture_scale(600, 900) == 1.0
    assert picture_scale(3000, 4000) == MAX_SIDE / 4000
    assert picture_scale(100, 2000) == MAX_SIDE / 2000  # the longer side bounds a long thin image


def _random_record(rng: np.random.Generator, h: int, w: int, n: int) -> RegionFeatures:
    x1, y1 = rng.uniform(0, 0.8 * w, n), rng.uniform(0, 0.8 * h, n)
    x2 = np.minimum(x1 + rng.uniform(0.05 * w, 0.5 * w, n), w)
    y2 = np.minimum(y1 + rng.uniform(0.05 * h, 0.5 * h, n), h)
    return RegionFeatures(
        img_id="r",
        img_h=h,
        img_w=w,
        boxes=np.stack([x1, y1, x2, y2], axis=1).astype(np.float32),
        features=np.zeros((n, 4), np.float32),
        objects_id=rng.integers(0, 1600, n),
        objects_conf=rng.uniform(0, 1, n).astype(np.float32),
        attrs_id=rng.integers(0, 400, n),
        attrs_conf=rng.uniform(0, 1, n).astype(np.float32),
    )


@pytest.mark.parametrize("size", SIZES)
def test_region_pictures_are_legible_at_any_size(size, shared_reference, assert_legible):
    objects, attributes = load_vg_vocab(shared_reference)
    rng = np.random.default_rng(sum(size))
    rec = _random_record(rng, *size, n=36)
    image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    drawing = draw_regions(image, rec, objects, attributes)
    assert_legible(drawing, size)
    # every region is named once, "attribute object", beside its box or in the legend under the image
    assert sorted(label.region for label in drawing.labels) == list(range(36))
    for label in drawing.labels:
        i = label.region
        assert label.text == f"{attributes[rec.attrs_id[i]]} {objects[rec.objects_id[i]]}"
        assert label.in_legend == (label.box[1] >= round(size[0] * picture_scale(*size)))


def test_layout_prefers_the_spot_above_the_box_and_never_overlaps():
    # two identical boxes: the first label goes above, the second inside the box's top
    spots = layout_labels([(50, 50, 150, 120)] * 2, [(60, 20)] * 2, 400, 300)
    assert spots == [(50, 30, 110, 50), (50, 50, 110, 70)]
    # a box at the top edge: no room above, so inside
    assert layout_labels([(10, 0, 100, 50)], [(40, 20)], 400, 300) == [(10, 0, 50, 20)]
    # a crowd of labels on one small box: placed apart, nearest first, the rest left for the legend
    spots = layout_labels([(0, 0, 20, 20)] * 50, [(150, 20)] * 50, 300, 200)
    placed = [s for s in spots if s is not None]
    assert placed[0] == (0, 0, 150, 20)  # no room above: inside the box's top
    assert len(placed) == 200 // 20 and spots[len(placed) :] == [None] * (50 - len(placed))
    assert not any(overlaps(a, b) for k, a in enumerate(placed) for b in placed[k + 1 :])
    # a label wider than the picture cannot be placed there
    assert layout_labels([(0, 0, 10, 10)], [(500, 20)], 300, 200) == [None]


def test_features_show_cli(tmp_path, vocab_dir, store_and_image):
    from pipelines.cli import main

    store, image = store_and_image
    out = tmp_path / "shown" / "img1.png"
    args = ["features", "show", str(store), "img1", "--image", str(image), "--out", str(out)]
    assert main([*args, "--vocab", str(vocab_dir)]) == 0
    drawn = cv2.imread(str(out))
    assert drawn.shape == (600, 800, 3) and (drawn != 127).any()  # enlarged: 60 px -> 600 px
    assert main(["features", "show", str(store), "nope", "--image", str(image), "--out", str(out)]) == 1


def _show(tmp_path, store_and_image, out_name: str, *extra: str) -> np.ndarray:
    from pipelines.cli import main

    store, image = store_and_image
    out = tmp_path / out_name
    assert (
        main(["features", "show", str(store), "img1", "--image", str(image), "--out", str(out), *extra]) == 0
    )
    return cv2.imread(str(out))


@pytest.fixture()
def store_and_image(tmp_path):
    from storage import FeatureWriter

    store = tmp_path / "feats"
    with FeatureWriter(store, feature_dim=8, max_boxes=36) as writer:
        writer.put(record())
    image = tmp_path / "img1.png"
    cv2.imwrite(str(image), np.full((60, 80, 3), 127, np.uint8))
    return store, image


def test_features_show_takes_the_vocab_from_the_environment(
    tmp_path, vocab_dir, store_and_image, monkeypatch
):
    from pipelines.commands.vg_vocab import VG_VOCAB_ENV

    monkeypatch.delenv(VG_VOCAB_ENV, raising=False)
    ids = _show(tmp_path, store_and_image, "ids.png")
    flag = _show(tmp_path, store_and_image, "flag.png", "--vocab", str(vocab_dir))
    assert not np.array_equal(ids, flag)  # names, not ids, were drawn
    monkeypatch.setenv(VG_VOCAB_ENV, str(vocab_dir))
    assert np.array_equal(_show(tmp_path, store_and_image, "env.png"), flag)
    monkeypatch.setenv(VG_VOCAB_ENV, str(tmp_path / "missing"))
    assert np.array_equal(_show(tmp_path, store_and_image, "flag_wins.png", "--vocab", str(vocab_dir)), flag)


def test_features_show_names_a_wrong_vocab_environment_variable(
    tmp_path, store_and_image, monkeypatch, caplog
):
    from pipelines.cli import main
    from pipelines.commands.vg_vocab import VG_VOCAB_ENV

    store, image = store_and_image
    monkeypatch.setenv(VG_VOCAB_ENV, str(tmp_path / "missing"))
    args = ["features", "show", str(store), "img1", "--image", str(image), "--out", str(tmp_path / "x.png")]
    assert main(args) == 1
    assert VG_VOCAB_ENV in caplog.text and "missing" in caplog.text


def test_features_show_with_the_shared_vg_vocabularies(
    tmp_path, shared_reference, store_and_image, monkeypatch
):
    from pipelines.commands.vg_vocab import VG_VOCAB_ENV

    monkeypatch.delenv(VG_VOCAB_ENV, raising=False)
    flag = _show(tmp_path, store_and_image, "flag.png", "--vocab", str(shared_reference))
    assert not np.array_equal(flag, _show(tmp_path, store_and_image, "ids.png"))
    monkeypatch.setenv(VG_VOCAB_ENV, str(shared_reference))
    assert np.array_equal(_show(tmp_path, store_and_image, "env.png"), flag)
