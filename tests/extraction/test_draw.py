"""Region drawing, VG vocabulary loading and `xmodal features show`."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from extraction.draw import draw_regions, load_vg_vocab, region_label
from storage import RegionFeatures


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
    drawn = draw_regions(image, record())
    assert drawn.shape == image.shape and drawn.dtype == np.uint8
    assert np.array_equal(image, np.full((60, 80, 3), 127, np.uint8))  # input untouched
    changed = np.any(drawn != image, axis=2)
    assert changed[30, 5:30].all()  # the first box's top edge
    assert not changed[56:, :].any() and not changed[:, :5].any() and not changed[:10, :].any()


def test_features_show_cli(tmp_path, vocab_dir, store_and_image):
    from pipelines.cli import main

    store, image = store_and_image
    out = tmp_path / "shown" / "img1.png"
    args = ["features", "show", str(store), "img1", "--image", str(image), "--out", str(out)]
    assert main([*args, "--vocab", str(vocab_dir)]) == 0
    drawn = cv2.imread(str(out))
    assert drawn.shape == (60, 80, 3) and (drawn != 127).any()
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
    from pipelines.commands.features import VG_VOCAB_ENV

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
    from pipelines.commands.features import VG_VOCAB_ENV

    store, image = store_and_image
    monkeypatch.setenv(VG_VOCAB_ENV, str(tmp_path / "missing"))
    args = ["features", "show", str(store), "img1", "--image", str(image), "--out", str(tmp_path / "x.png")]
    assert main(args) == 1
    assert VG_VOCAB_ENV in caplog.text and "missing" in caplog.text


def test_features_show_with_the_shared_vg_vocabularies(
    tmp_path, shared_reference, store_and_image, monkeypatch
):
    from pipelines.commands.features import VG_VOCAB_ENV

    monkeypatch.delenv(VG_VOCAB_ENV, raising=False)
    flag = _show(tmp_path, store_and_image, "flag.png", "--vocab", str(shared_reference))
    assert not np.array_equal(flag, _show(tmp_path, store_and_image, "ids.png"))
    monkeypatch.setenv(VG_VOCAB_ENV, str(shared_reference))
    assert np.array_equal(_show(tmp_path, store_and_image, "env.png"), flag)
