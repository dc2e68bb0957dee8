"""FID through torch-fidelity: the distance of given feature statistics is the Fréchet formula written here
with scipy's sqrtm; without weights the reason names what to provide; a weights file carrying code is
refused before torch-fidelity unpickles it; with a weights file of Inception's layout the features of
real images go through the same formula."""

from __future__ import annotations

import pickle
from unittest import mock

import numpy as np
import pytest
import scipy.linalg
import torch
from PIL import Image

from pipelines.scoring.fid import (
    WEIGHTS_NAME,
    FidError,
    InceptionFeatures,
    fid,
    frechet_distance,
    skip_reason,
    statistics,
)

pytest.importorskip("torch_fidelity", reason="torch-fidelity (the `fid` extra) is not installed")


def scipy_fid(a: np.ndarray, b: np.ndarray) -> float:
    """Heusel et al.'s formula on (n, d) features: ||mu_a - mu_b||^2 + tr(S_a + S_b - 2 sqrtm(S_a S_b))."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = scipy.linalg.sqrtm(s_a @ s_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a + s_b - 2 * covmean))


def test_distance_of_feature_statistics_is_the_frechet_formula():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(200, 8))
    b = rng.normal(0.5, 1.5, size=(150, 8)) @ rng.normal(size=(8, 8))
    ours = frechet_distance(statistics(torch.from_numpy(a)), statistics(torch.from_numpy(b)))
    assert ours == pytest.approx(scipy_fid(a, b), rel=1e-6)
    assert frechet_distance(
        statistics(torch.from_numpy(a)), statistics(torch.from_numpy(a))
    ) == pytest.approx(0.0, abs=1e-6)


def test_without_weights_the_reason_names_what_to_provide():
    reason = skip_reason(None, None)
    assert (
        "\n" not in reason
        and "--fid-weights" in reason
        and WEIGHTS_NAME in reason
        and "--fid-images" in reason
    )
    assert skip_reason("w.pth", "images/") is None


class _RunsCode:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_weights_file_carrying_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"w": _RunsCode()}, path)
    with pytest.raises(FidError, match="not a tensor-only state dict") as err:
        InceptionFeatures(path)
    assert "\n" not in str(err.value)
    path.write_bytes(pickle.dumps("x"))
    with pytest.raises(FidError):
        InceptionFeatures(path)
    with pytest.raises(FidError, match="is not a file"):
        InceptionFeatures(tmp_path / "missing.pth")


@pytest.fixture(scope="module")
def random_inception_weights(tmp_path_factory):
    """A state dict of torch-fidelity's Inception layout with random values (the real one is downloaded)."""
    import torch_fidelity.feature_extractor_inceptionv3 as fe

    torch.manual_seed(0)
    with (
        mock.patch.object(fe, "load_state_dict_from_url", lambda *a, **k: {}),
        mock.patch.object(fe.FeatureExtractorInceptionV3, "load_state_dict", lambda self, state: None),
    ):
        model = fe.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    for module in model.modules():  # variance-keeping init, so that pool3 features are not ~0
        if isinstance(module, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    path = tmp_path_factory.mktemp("inception") / WEIGHTS_NAME
    torch.save(model.state_dict(), path)
    return path


class PooledPixels(torch.nn.Module):
    """Stands in for Inception's forward (seconds an image at 299 x 299 on a busy CPU): torch-fidelity's
    input contract (uint8 N x 3 x H x W) in, a tuple of (N, 12) features out: 2 x 2 mean-pooled pixels."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        assert x.dtype == torch.uint8 and x.dim() == 4 and x.shape[1] == 3
        return (torch.nn.functional.adaptive_avg_pool2d(x.float(), 2).flatten(1),)


def test_fid_of_images_is_the_formula_on_their_features(random_inception_weights):
    """The weights load into torch-fidelity's Inception; the images reach the network as RGB uint8 in
    batches, and their features go through the formula (features recomputed here from the pixels)."""
    extractor = InceptionFeatures(random_inception_weights, batch_size=2)
    assert sum(p.numel() for p in extractor.model.parameters()) > 20_000_000  # the real network was built
    extractor.model = PooledPixels()
    rng = np.random.default_rng(1)
    arrays_a = [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(5)]
    arrays_b = [rng.integers(0, 120, (8, 8, 3), dtype=np.uint8) for _ in range(3)]

    def pooled(arrays):  # (H, W, 3) RGB -> the 2 x 2 quadrant means, channel-major like the network's
        return np.stack([a.astype(np.float64).reshape(2, 4, 2, 4, 3).mean((1, 3)).transpose(2, 0, 1).ravel()
                         for a in arrays])  # fmt: skip

    value = fid([Image.fromarray(a) for a in arrays_a], [Image.fromarray(a) for a in arrays_b], extractor)
    expected = scipy_fid(pooled(arrays_a), pooled(arrays_b))
    assert expected > 1.0 and value == pytest.approx(expected, rel=1e-6)


def test_evaluate_takes_both_fid_inputs_or_none(random_inception_weights, tmp_path):
    from pipelines.apps.generate.evaluate import load_fid

    assert load_fid(None, None, 16) is None  # skipped, with skip_reason in the result
    with pytest.raises(FidError, match="go together"):
        load_fid(str(random_inception_weights), None, 16)
    with pytest.raises(FidError, match="is not a folder"):
        load_fid(str(random_inception_weights), str(tmp_path / "nope"), 16)
    real = tmp_path / "real"
    real.mkdir()
    for i in range(2):
        Image.new("RGB", (20, 12), (i * 100, 0, 0)).save(real / f"{i}.png")
    inputs = load_fid(str(random_inception_weights), str(real), 16)
    assert [im.size for im in inputs.real] == [(16, 16), (16, 16)]
