"""The DALL-E transformer: shapes, causality over the joint sequence, the sparse masks in use, the 1/8 : 7/8
loss against an independent computation, sampling filters, and learning to draw a caption's tokens."""

from __future__ import annotations

import math

import pytest
import torch

from model.dalle import DalleConfig, DalleTransformer, sample_token

# Odd sizes so a swapped dimension cannot pass.
SMALL = {
    "text_vocab_size": 37,
    "text_length": 5,
    "image_vocab_size": 23,
    "image_grid": 4,
    "num_layers": 3,
    "num_heads": 2,
    "hidden_size": 16,
    "conv_kernel": 3,
}


def model(attention: str = "dense", **overrides) -> DalleTransformer:
    torch.manual_seed(0)
    return DalleTransformer(
        DalleConfig.preset("small", **{**SMALL, "attention": attention, **overrides})
    ).eval()


def inputs(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 37, (batch, 5), generator=g), torch.randint(0, 23, (batch, 16), generator=g)


def test_logit_shapes_for_full_and_partial_images():
    m = model()
    text, image = inputs()
    out = m(text, image)
    assert out.text_logits.shape == (2, 4, 37 + 5)  # the vocabulary and one padding token per position
    assert out.image_logits.shape == (2, 16, 23)
    assert m(text, image[:, :6]).image_logits.shape == (2, 7, 23)
    assert m(text).image_logits.shape == (2, 1, 23)


def test_the_papers_configuration_has_its_shapes():
    cfg = DalleConfig.preset("paper")
    assert (cfg.text_length, cfg.text_vocab_size, cfg.image_length, cfg.image_vocab_size) == (
        256,
        16384,
        1024,
        8192,
    )
    assert (cfg.num_layers, cfg.num_heads, cfg.hidden_size) == (64, 62, 3968)
    with torch.device("meta"):
        params = sum(p.numel() for p in DalleTransformer(cfg).parameters())
    assert 11.5e9 < params < 12.5e9  # "12 billion parameters"


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_changing_a_later_token_never_changes_earlier_logits(attention):
    m = model(attention)
    text, image = inputs(batch=1)

    def per_position(out) -> list[torch.Tensor]:  # entry p: the prediction made at position p
        return [*out.text_logits[0], *out.image_logits[0]]

    base = per_position(m(text, image))
    for p in range(1, 5 + 15):
        t2, i2 = text.clone(), image.clone()
        if p < 5:
            t2[0, p] = (t2[0, p] + 1) % 37
        else:
            i2[0, p - 5] = (i2[0, p - 5] + 1) % 23
        changed = per_position(m(t2, i2))
        # Predictions made before seeing token p are exactly the same...
        assert all(torch.equal(a, b) for a, b in zip(changed[:p], base[:p], strict=True)), p
        # ...and the one made at p is not (the change is seen).
        assert not torch.allclose(changed[p], base[p]), p


def test_a_single_sparse_layer_hides_image_tokens_outside_its_window():
    """One layer under the paper's schedule is the convolutional mask: the last input image token, (3, 2),
    sees (2, 2) but not (0, 0), and it sees all text."""
    m = model("sparse", num_layers=1)
    assert m.mask_kinds == ["conv"]
    text, image = inputs(batch=1)
    base = m(text, image).image_logits[0, -1]

    def logits_after(index: int) -> torch.Tensor:
        changed = image.clone()
        changed[0, index] = (changed[0, index] + 1) % 23
        return m(text, changed).image_logits[0, -1]

    assert torch.equal(logits_after(0), base)  # (0, 0): three rows up, outside the 3 x 3 window
    assert not torch.allclose(logits_after(10), base)  # (2, 2)
    t2 = text.clone()
    t2[0, 0] = (t2[0, 0] + 1) % 37
    assert not torch.allclose(m(t2, image).image_logits[0, -1], base)


def test_loss_is_one_eighth_text_plus_seven_eighths_image_cross_entropy():
    m = model()
    text, image = inputs(batch=3)
    out = m(text, image)
    # Independent: log-probabilities of the targets, averaged over every token of each kind in the batch.
    text_logp = out.text_logits.log_softmax(-1).gather(-1, text[:, 1:, None])
    image_logp = out.image_logits.log_softmax(-1).gather(-1, image[:, :, None])
    expected = -(text_logp.sum() / text_logp.numel()) / 8 - 7 * (image_logp.sum() / image_logp.numel()) / 8
    loss = m.loss(text, image)
    assert torch.allclose(loss.loss, expected, atol=1e-6)
    assert torch.allclose(loss.text, -text_logp.mean(), atol=1e-6)


def test_padding_positions_get_their_own_tokens():
    m = model()
    ids = torch.tensor([[3, 9, 4, 0, 0]])
    padded = m.pad_text(ids, ids == 0)
    assert padded.tolist() == [[3, 9, 4, 37 + 3, 37 + 4]]


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    assert set(sample_token(logits, 2, None, g).tolist()) == {0, 1}
    # Nucleus 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it; 0.15 and 0.05 are cut.
    assert set(sample_token(logits, None, 0.7, g).tolist()) == {0, 1}
    counts = torch.bincount(sample_token(logits, None, None, g), minlength=4) / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_learns_to_draw_each_captions_image_and_generates_it():
    """Two captions, two token grids: after training, sampling with top_k=1 reproduces each grid."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = DalleTransformer(DalleConfig.preset("small", **{**SMALL, "hidden_size": 32, "attention": "sparse"}))
    text = torch.tensor([[1, 5, 6, 0, 0], [1, 7, 8, 0, 0]])
    text = m.pad_text(text, text == 0)
    image = torch.randint(0, 23, (2, 16), generator=torch.Generator().manual_seed(3))
    optimiser = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(150):
        loss = m.loss(text, image)
        optimiser.zero_grad()
        loss.loss.backward()
        optimiser.step()
    m.eval()
    assert torch.equal(m.generate(text, top_k=1), image)
    # The captions are learnt too, down to the one unpredictable choice: the first word (ln 2 over 4 tokens).
    assert loss.text < math.log(2) / 4 + 0.05


def _greedy_guided(
    m: DalleTransformer, text: torch.Tensor, empty: torch.Tensor, scale: float
) -> torch.Tensor:
    """Greedy decoding from u + s (c - u), the conditional and unconditional logits from separate passes."""
    image = text.new_zeros(text.shape[0], 0)
    with torch.no_grad():
        for _ in range(m.config.image_length):
            c = m(text, image).image_logits[:, -1]
            u = m(empty.expand(text.shape[0], -1), image).image_logits[:, -1]
            image = torch.cat([image, (u + scale * (c - u)).argmax(-1, keepdim=True)], dim=1)
    return image


def test_classifier_free_guidance_follows_the_guided_logits():
    m = model()
    text, _ = inputs(batch=3, seed=4)
    empty = m.pad_text(torch.tensor([[1, 2, 0, 0, 0]]), torch.tensor([[False, False, True, True, True]]))
    for scale in (3.0, 0.0):
        assert torch.equal(
            m.generate(text, top_k=1, guidance=scale, unconditional=empty),
            _greedy_guided(m, text, empty, scale),
        )
    # s = 0 is the unconditional model; s = 1 draws exactly what unguided sampling draws
    assert torch.equal(
        m.generate(text, top_k=1, guidance=0.0, unconditional=empty), m.generate(empty.expand(3, -1), top_k=1)
    )
    plain = m.generate(text, generator=torch.Generator().manual_seed(7))
    same = m.generate(text, generator=torch.Generator().manual_seed(7), guidance=1.0, unconditional=empty)
    assert torch.equal(plain, same)
    with pytest.raises(ValueError, match="unconditional"):
        m.generate(text, guidance=2.0)
