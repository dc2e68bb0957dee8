"""The tiny preset can learn to ground a word in a region and answer with that region's position.

The demo's "is the (shape) on the left or the right" questions sat at their prior with the tiny preset's
old BERT-base init (std 0.02 at width 64: every projection shrank its input about 6 times, attention
stayed uniform, and with other question types beside it the side question collapsed to a constant).
The scenes here are the demo's in miniature, as tensors: up to 3 objects, each a (shape, colour)
feature on the left or the right half, among background regions."""

from __future__ import annotations

import pytest
import torch

from model.lxmert.config import LxmertConfig
from model.lxmert.finetuning import LxmertForQuestionAnswering

SHAPES, COLOURS, REGIONS, DIM = 3, 4, 6, 16
# tokens: 0 pad, 1 [CLS], 2 [SEP], 3 "side", 4 "colour", 5..7 shapes
CLS, SEP, SIDE, COLOUR = 1, 2, 3, 4
# answers: 0 left, 1 right, 2..5 colours
LEFT, RIGHT = 0, 1


def scenes(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """n questions, half "side of (shape)?", half "colour of (shape)?", each on its own scene."""
    objects = torch.randint(1, 4, (n,), generator=gen)
    shape = torch.stack([torch.randperm(SHAPES, generator=gen) for _ in range(n)])  # distinct shapes
    colour = torch.randint(0, COLOURS, (n, REGIONS), generator=gen)
    real = torch.arange(REGIONS)[None] < objects[:, None]
    feats = torch.zeros(n, REGIONS, DIM)
    rows = torch.arange(n)[:, None].expand(n, REGIONS)
    slots = torch.arange(REGIONS)[None].expand(n, REGIONS)
    feats[rows[real], slots[real], shape.gather(1, slots.clamp(max=SHAPES - 1))[real]] = 1.0
    feats[rows[real], slots[real], SHAPES + colour[real]] = 1.0
    feats[~real, DIM - 1] = 1.0  # background
    feats += 0.1 * torch.randn(n, REGIONS, DIM, generator=gen)
    x1 = torch.rand(n, REGIONS, generator=gen) * 0.75
    boxes = torch.stack(
        [x1, torch.rand(n, REGIONS, generator=gen) * 0.5, x1 + 0.25, torch.full((n, REGIONS), 0.9)], -1
    )
    asked = (torch.rand(n, generator=gen) * objects).long()  # one of the scene's objects
    kind = torch.rand(n, generator=gen) < 0.5  # True: side, False: colour
    pick = torch.arange(n)
    centre = (boxes[pick, asked, 0] + boxes[pick, asked, 2]) / 2
    answer = torch.where(kind, (centre > 0.5).long(), 2 + colour[pick, asked])
    tokens = torch.stack(
        [
            torch.full((n,), CLS),
            torch.where(kind, SIDE, COLOUR),
            5 + shape[pick, asked],
            torch.full((n,), SEP),
        ],
        1,
    )
    return {
        "input_ids": tokens,
        "visual_feats": feats,
        "visual_pos": boxes,
        "labels": torch.nn.functional.one_hot(answer, 2 + COLOURS).float(),
        "side": kind,
    }


def side_accuracy(cfg: LxmertConfig, steps: int, seed: int) -> tuple[float, float]:
    """(held-out accuracy of the side question, its majority-answer prior) after `steps` Adam steps."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = LxmertForQuestionAnswering(cfg, 2 + COLOURS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        batch = scenes(32, gen)
        batch.pop("side")
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    test = scenes(400, gen)
    side = test.pop("side")
    with torch.no_grad():
        predicted = model(**test).logits.argmax(-1)
    truth = test["labels"].argmax(-1)
    right_share = float((truth[side] == RIGHT).float().mean())
    return float((predicted[side] == truth[side]).float().mean()), max(right_share, 1 - right_share)


@pytest.mark.slow
def test_tiny_preset_learns_where_a_named_object_is():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a busy machine
    try:
        cfg = LxmertConfig.preset("tiny", visual_feat_dim=DIM, vocab_size=5 + SHAPES)
        accuracy, prior = side_accuracy(cfg, steps=500, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert accuracy >= prior + 0.25, f"side accuracy {accuracy:.2f} vs prior {prior:.2f}"
