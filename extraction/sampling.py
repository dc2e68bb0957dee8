"""Training-time matching and sampling shared by the RPN and the RoI head (detectron2's Matcher and
subsample_labels): IoU thresholds turn each anchor or proposal into positive / negative / ignored, and a
fixed-size random sample keeps at most a given fraction of positives."""

from __future__ import annotations

import torch

IGNORE = -1


class Matcher:
    """Each column (anchor or proposal) gets the row (ground-truth box) it overlaps most and a label from
    the IoU band it falls in: `thresholds` [t1, ..., tk] cut [0, 1] into k+1 bands labelled `labels`.

    With `allow_low_quality_matches`, every ground-truth box's best-overlapping columns (ties included) are
    labelled positive whatever their IoU, so no box goes without a match (detectron2's RPN matcher)."""

    def __init__(self, thresholds: list[float], labels: list[int], allow_low_quality_matches: bool = False):
        if len(labels) != len(thresholds) + 1:
            raise ValueError(
                f"need one label per IoU band: {len(thresholds)} thresholds, {len(labels)} labels"
            )
        if sorted(thresholds) != list(thresholds):
            raise ValueError(f"IoU thresholds must increase: {thresholds}")
        self.thresholds = [float("-inf"), *thresholds, float("inf")]
        self.labels = labels
        self.allow_low_quality_matches = allow_low_quality_matches

    def __call__(self, quality: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """IoU matrix (G, N) -> (matched row (N,) int64, label (N,) int8). With no rows, every column is
        matched to row 0 and gets the lowest band's label."""
        n = quality.shape[1]
        if quality.shape[0] == 0:
            return (
                quality.new_zeros(n, dtype=torch.int64),
                quality.new_full((n,), self.labels[0], dtype=torch.int8),
            )
        matched_vals, matches = quality.max(dim=0)
        match_labels = matches.new_ones(n, dtype=torch.int8)
        for label, low, high in zip(self.labels, self.thresholds[:-1], self.thresholds[1:], strict=True):
            match_labels[(matched_vals >= low) & (matched_vals < high)] = label
        if self.allow_low_quality_matches:
            best_per_row = quality.max(dim=1).values
            _, columns = torch.nonzero(quality == best_per_row[:, None], as_tuple=True)
            match_labels[columns] = 1
        return matches, match_labels


def subsample_labels(
    labels: torch.Tensor,
    num_samples: int,
    positive_fraction: float,
    bg_label: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of at most `num_samples` labels, at most `positive_fraction` of them positive (neither
    IGNORE nor `bg_label`), the rest negative (`bg_label`), each drawn uniformly without replacement."""
    positive = torch.nonzero((labels != IGNORE) & (labels != bg_label)).squeeze(1)
    negative = torch.nonzero(labels == bg_label).squeeze(1)
    num_pos = min(int(num_samples * positive_fraction), positive.numel())
    num_neg = min(num_samples - num_pos, negative.numel())
    pos_perm = torch.randperm(positive.numel(), generator=generator)[:num_pos].to(labels.device)
    neg_perm = torch.randperm(negative.numel(), generator=generator)[:num_neg].to(labels.device)
    return positive[pos_perm], negative[neg_perm]
