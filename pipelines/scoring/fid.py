"""Fréchet Inception Distance through torch-fidelity (its TF-compatible Inception-v3, pool3 2048-d
features, its statistics and distance), with the Inception weights the user provides: nothing is
downloaded, and without them FID is skipped with the reason."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"  # torch-fidelity's release file
FEATURE = "2048"  # pool3, the features FID is defined on
NEEDS = (
    f"give --fid-weights PATH (torch-fidelity's {WEIGHTS_NAME}, from its GitHub release v0.2.0) and "
    "--fid-images DIR (real images to compare with)"
)


class FidError(ValueError):
    """The FID inputs the user gave cannot be used (a missing or unsafe weights file, no real images)."""


def skip_reason(weights: str | None, images: str | None) -> str | None:
    """Why FID cannot be computed with these settings (one line naming what to provide), or None."""
    if importlib.util.find_spec("torch_fidelity") is None:
        return "FID needs torch-fidelity: pip install 'xmodal[fid]' (or torch-fidelity), then " + NEEDS
    if not weights or not images:
        return "FID needs the Inception weights, which are not downloaded here: " + NEEDS
    return None


def statistics(features: torch.Tensor) -> dict[str, np.ndarray]:
    """Mean and covariance of (n, d) features, as torch-fidelity computes them (float64)."""
    from torch_fidelity.metric_fid import fid_features_to_statistics

    if features.shape[0] < 2:
        raise FidError(f"FID needs at least 2 images per set, got {features.shape[0]}")
    return fid_features_to_statistics(features.double().cpu())


def frechet_distance(stats_1: dict[str, np.ndarray], stats_2: dict[str, np.ndarray]) -> float:
    """||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2)) by torch-fidelity."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    return float(fid_statistics_to_metric(stats_1, stats_2, verbose=False)[KEY_METRIC_FID])


class InceptionFeatures:
    """torch-fidelity's Inception-v3 (`inception-v3-compat`) on the weights file at `weights`."""

    def __init__(self, weights: str | Path, batch_size: int = 16) -> None:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        path = Path(weights)
        if not path.is_file():
            raise FidError(f"--fid-weights {str(path)!r} is not a file; " + NEEDS)
        try:
            # torch-fidelity unpickles the file in full; read it as plain tensors first so that a file
            # carrying code is refused here instead of run there
            torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise FidError(f"--fid-weights {str(path)!r} is not a tensor-only state dict ({first})") from exc
        try:
            self.model = FeatureExtractorInceptionV3("inception-v3-compat", [FEATURE], str(path)).eval()
        except RuntimeError as exc:  # load_state_dict: the wrong network's weights
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise FidError(f"--fid-weights {str(path)!r} is not {WEIGHTS_NAME} ({first})") from exc
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """(n, 2048) pool3 features of RGB images (torch-fidelity resizes them to 299 x 299 itself)."""
        out = []
        for start in range(0, len(images), self.batch_size):
            batch = np.stack(
                [np.asarray(im.convert("RGB")) for im in images[start : start + self.batch_size]]
            )
            (features,) = self.model(torch.from_numpy(batch).permute(0, 3, 1, 2).contiguous())
            out.append(features)
        return torch.cat(out)


def fid(generated: Sequence[Image.Image], real: Sequence[Image.Image], extractor: InceptionFeatures) -> float:
    """FID between two image sets (a few thousand each for a stable value; fewer gives a biased one)."""
    return frechet_distance(statistics(extractor(generated)), statistics(extractor(real)))
