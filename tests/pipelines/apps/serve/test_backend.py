"""`load_backend`: which checkpoints make a server, which are refused, and what is said when they disagree."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from pipelines.apps.serve.backend import load_backend
from pipelines.tasks.finetune import RUN_FILE

from .conftest import decoded, scene_png


def test_a_captioner_alone_makes_a_server_that_describes(caption_checkpoint, backend):
    with pytest.warns(UserWarning, match="RANDOM weights"):
        alone = load_backend(caption_checkpoint)
    assert alone.answerer is None and alone.captioner.checkpoint == str(caption_checkpoint)
    assert alone.describe()["model"] is None and alone.describe()["caption"]["task"] == "caption"
    (regions,) = alone.detect([decoded(scene_png())], ["scene.png"])
    (reference,) = backend.detect([decoded(scene_png())], ["scene.png"])  # same recorded detector
    np.testing.assert_array_equal(regions.boxes, reference.boxes)
    assert alone.caption(regions, 2).caption == backend.caption(reference, 2).caption
    with pytest.raises(LookupError, match="no question-answering model"):
        alone.answer(regions, "what?", 3)


@pytest.mark.parametrize(
    ("which", "message"),
    [
        (("vqa", "vqa"), "--caption-checkpoint {vqa} is a vqa model, not a captioner"),
        (("caption", "caption"), "{caption} and {caption} are both captioners; give one"),
        (
            (None, None),
            "give --checkpoint (a VQA/GQA model or a captioner), --caption-checkpoint or "
            "--generate-checkpoint",
        ),
    ],
)
def test_checkpoints_that_cannot_serve_together_are_refused_before_the_detector_is_built(
    checkpoint, caption_checkpoint, which, message
):
    paths = {"vqa": checkpoint, "caption": caption_checkpoint, None: None}
    first, second = (paths[w] for w in which)
    with pytest.raises(ValueError) as raised:
        load_backend(first, caption_checkpoint=second)
    assert str(raised.value) == message.format(vqa=checkpoint, caption=caption_checkpoint)


def test_a_captioner_trained_on_other_detector_settings_is_served_with_a_warning(
    checkpoint, caption_checkpoint, tmp_path, caplog
):
    other = shutil.copytree(caption_checkpoint, tmp_path / "caption")
    settings = json.loads((other / RUN_FILE).read_text())
    settings["detector"]["config"]["min_size"] = 80
    (other / RUN_FILE).write_text(json.dumps(settings))
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="RANDOM weights"):
        both = load_backend(checkpoint, caption_checkpoint=other)
    assert both.detector.provenance()["config"]["min_size"] == 96  # the VQA model's detector
    warned = [r.getMessage() for r in caplog.records if "other detector settings" in r.getMessage()]
    assert warned == [
        f"{other} was trained on features from other detector settings (min_size) than {checkpoint}: it "
        f"sees the regions of {checkpoint}'s detector"
    ]
