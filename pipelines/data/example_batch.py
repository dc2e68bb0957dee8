"""`ExampleBatch`: a micro-batch of NLVR2, retrieval or caption examples column by column, its images'
regions read in one store transaction (features as stored, widened on the device)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.data.regions import PaddedRegions, read_regions


@dataclass
class ExampleBatch:
    """B examples of K images each: `regions` rows k*K .. k*K+K-1 are example k's images (`images`, as
    the rows name them); `token_ids` (B, L) right-padded with `lengths`, or None for tasks without input
    text; `labels` (B,) None unless every example has one; `captions` per example, each a list of
    encoded reference captions (captioning only)."""

    ids: list
    images: list[str]
    regions: PaddedRegions
    token_ids: np.ndarray | None = None
    lengths: np.ndarray | None = None
    labels: np.ndarray | None = None
    captions: list[list[np.ndarray]] | None = None

    @property
    def size(self) -> int:
        return len(self.ids)

    @staticmethod
    def read(
        features,
        ids: list,
        images: list[str],
        texts=None,
        rows: np.ndarray | None = None,
        pad_id: int = 0,
        labels: np.ndarray | None = None,
        captions: list[list[np.ndarray]] | None = None,
    ) -> ExampleBatch:
        """The batch of `ids` whose images are `images` (one transaction), text rows `rows` of `texts`."""
        return ExampleBatch(
            ids=ids,
            images=images,
            regions=read_regions(features, images),
            token_ids=texts.padded(rows, pad_id) if texts is not None else None,
            lengths=texts.lengths(rows) if texts is not None else None,
            labels=labels,
            captions=captions,
        )

    @staticmethod
    def concat(batches: Sequence[ExampleBatch], pad_id: int = 0) -> ExampleBatch:
        """Several batches (e.g. single examples a DataLoader fetched one by one) as one, text and
        regions padded to the widest."""
        if len(batches) == 1:
            return batches[0]

        def pad(a: np.ndarray, width: int, value=0) -> np.ndarray:
            grow = [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2)
            return np.pad(a, grow, constant_values=value)

        token_ids = lengths = None
        if all(b.token_ids is not None for b in batches):
            length = max(b.token_ids.shape[1] for b in batches)
            token_ids = np.concatenate([pad(b.token_ids, length, pad_id) for b in batches])
            lengths = np.concatenate([b.lengths for b in batches])
        labels = [b.labels for b in batches]
        captions = [b.captions for b in batches]
        return ExampleBatch(
            ids=[i for b in batches for i in b.ids],
            images=[i for b in batches for i in b.images],
            regions=PaddedRegions.concat([b.regions for b in batches]),
            token_ids=token_ids,
            lengths=lengths,
            labels=np.concatenate(labels) if all(x is not None for x in labels) else None,
            captions=[c for x in captions for c in x] if all(x is not None for x in captions) else None,
        )

    def text_inputs(self) -> dict[str, torch.Tensor]:
        """`input_ids`, `attention_mask` (1 = real token) and zero `token_type_ids`."""
        ids = torch.from_numpy(self.token_ids)
        attention = np.arange(self.token_ids.shape[1])[None, :] < self.lengths[:, None]
        return {
            "input_ids": ids,
            "attention_mask": torch.from_numpy(attention.astype(np.int64)),
            "token_type_ids": torch.zeros_like(ids),
        }


def as_batch(items: ExampleBatch | Sequence[ExampleBatch], pad_id: int = 0) -> ExampleBatch:
    """What a dataset's `__getitems__` gave (one batch), or DataLoader's list of single-example batches,
    as one batch."""
    return items if isinstance(items, ExampleBatch) else ExampleBatch.concat(list(items), pad_id)
