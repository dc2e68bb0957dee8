"""Generated scenes for the captioner tests: two coloured shapes described left to right, plus padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

COLOURS = ("red", "green", "blue")
SHAPES = ("cube", "ball", "cone")
WORDS = ("<pad>", "<bos>", "<eos>", "<unk>", "a", "left", "of", *COLOURS, *SHAPES)
FEATURE_DIM = 32


@dataclass
class CaptionSet:
    features: torch.Tensor  # (B, 4, FEATURE_DIM); regions 2, 3 are padding for half of the images
    mask: torch.Tensor  # (B, 4)
    captions: torch.Tensor  # (B, T) <bos> … <eos> <pad>
    references: dict[int, list[str]]

    def inputs(self) -> dict[str, torch.Tensor]:
        """Teacher-forcing keyword arguments of a captioner: read words[:-1], predict words[1:]."""
        return {
            "input_ids": self.captions[:, :-1],
            "visual_feats": self.features,
            "visual_attention_mask": self.mask,
            "labels": self.captions[:, 1:],
        }


def make_caption_set(images: int = 48, seed: int = 0) -> CaptionSet:
    """'a COLOUR SHAPE left of a COLOUR SHAPE', the left object first; distractor regions are padding."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(images, 4, FEATURE_DIM, generator=g) * 0.1
    mask = torch.ones(images, 4, dtype=torch.bool)
    mask[images // 2 :, 2:] = False
    features[~mask] = torch.randn(int((~mask).sum()), FEATURE_DIM, generator=g) * 5.0
    captions, references = [], {}
    for i in range(images):
        objects = []
        for r in range(2):
            colour, shape = (int(v) for v in torch.randint(0, 3, (2,), generator=g))
            x = float(torch.rand((), generator=g))
            features[i, r, colour] += 1.0
            features[i, r, 3 + shape] += 1.0
            features[i, r, 6] = x
            objects.append((x, COLOURS[colour], SHAPES[shape]))
        (_, c1, s1), (_, c2, s2) = sorted(objects)
        words = ["a", c1, s1, "left", "of", "a", c2, s2]
        references[i] = [" ".join(words)]
        captions.append([1, *(WORDS.index(w) for w in words), 2])
    return CaptionSet(features, mask, torch.tensor(captions), references)


def decode(tokens: torch.Tensor) -> str:
    words = []
    for t in tokens.tolist():
        if t == 2:
            break
        if t > 3:
            words.append(WORDS[t])
    return " ".join(words)
