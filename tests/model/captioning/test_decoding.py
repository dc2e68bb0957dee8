"""Greedy, sampled and beam decoding: beam 1 is greedy, beams are batched, padded regions get no attention."""

from __future__ import annotations

import pytest
import torch

from model.captioning import (
    CaptionConfig,
    HardAttentionCaptioner,
    SoftAttentionCaptioner,
    UpDownCaptioner,
    beam_search,
    greedy,
    sample,
)

from .conftest import FEATURE_DIM, WORDS, make_caption_set

ARCHS = {"updown": UpDownCaptioner, "sat-soft": SoftAttentionCaptioner, "sat-hard": HardAttentionCaptioner}


def build(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = CaptionConfig.preset("tiny", vocab_size=len(WORDS), visual_feat_dim=FEATURE_DIM, **overrides)
    return ARCHS[arch](cfg).eval()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_beam_one_equals_greedy(arch):
    model = build(arch)
    data = make_caption_set(6)
    g = greedy(model, data.features, data.mask)
    b = beam_search(model, data.features, data.mask, beam_size=1)
    assert torch.equal(b.best, g.tokens)
    torch.testing.assert_close(b.attentions[:, 0], g.attentions)
    lengths = g.mask.sum(1)
    torch.testing.assert_close(b.scores[:, 0], g.logprobs.sum(1))
    assert torch.equal(b.lengths[:, 0], lengths)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_teacher_forcing_equals_stepping(arch):
    """The unrolled training pass (inputs projected once) computes what `step` does word by word."""
    model = build(arch)
    data = make_caption_set(5)
    with torch.no_grad():
        out = model(**data.inputs(), output_attentions=True)
        ctx = model.encode(data.features, data.mask)
        state = model.init_state(ctx)
        for t in range(data.captions.shape[1] - 1):
            step = model.step(data.captions[:, t], state, ctx)
            state = step.state
            torch.testing.assert_close(out.logits[:, t], step.logits, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out.attentions[:, t], step.alpha, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_beam_rows_are_independent_and_ranked(arch):
    """A batch decodes like its images one at a time; beams come back best first."""
    model = build(arch)
    data = make_caption_set(4)
    together = beam_search(model, data.features, data.mask, beam_size=3, length_alpha=0.7)
    for i in range(4):
        alone = beam_search(
            model, data.features[i : i + 1], data.mask[i : i + 1], beam_size=3, length_alpha=0.7
        )
        steps = alone.tokens.shape[-1]
        assert torch.equal(alone.tokens[0], together.tokens[i, :, :steps])
        torch.testing.assert_close(alone.scores[0], together.scores[i])
    assert bool((together.scores[:, :-1] >= together.scores[:, 1:]).all())


def test_beam_search_beats_greedy_probability():
    """Beam K ≥ 1 never finds a less probable caption than greedy (no length penalty)."""
    model = build("updown", seed=3)
    data = make_caption_set(8, seed=1)
    g = greedy(model, data.features, data.mask)
    b = beam_search(model, data.features, data.mask, beam_size=4)
    assert bool((b.scores[:, 0] >= g.logprobs.sum(1) - 1e-5).all())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_padded_regions_never_attended(arch):
    """Padding has zero attention, and changing its features changes nothing."""
    model = build(arch)
    data = make_caption_set(6)
    padded = ~data.mask
    assert padded.any()
    with torch.no_grad():
        out = model(**data.inputs(), output_attentions=True)
    assert (
        float(out.attentions.masked_select(padded.unsqueeze(1).expand_as(out.attentions)).abs().max()) == 0.0
    )
    torch.testing.assert_close(out.attentions.sum(-1), torch.ones_like(out.attentions.sum(-1)))
    noisy = data.features.clone()
    noisy[padded] = torch.randn(int(padded.sum()), FEATURE_DIM) * 100
    with torch.no_grad():
        again = model(**{**data.inputs(), "visual_feats": noisy})
    torch.testing.assert_close(again.logits, out.logits)
    beams = beam_search(model, noisy, data.mask, beam_size=3)
    assert torch.equal(beams.tokens, beam_search(model, data.features, data.mask, beam_size=3).tokens)
    assert (
        float(beams.attentions.masked_select(padded[:, None, None].expand_as(beams.attentions)).sum()) == 0.0
    )


def test_sample_keeps_gradient_and_stops_at_eos():
    model = build("updown").train()
    data = make_caption_set(5)
    out = sample(model, data.features, data.mask, generator=torch.Generator().manual_seed(0))
    assert out.logprobs.requires_grad
    (-out.logprobs.sum()).backward()
    assert model.output.weight.grad is not None
    for tokens, alive in zip(out.tokens, out.mask, strict=True):
        ends = (tokens == 2).nonzero()
        if len(ends):
            assert not alive[int(ends[0]) + 1 :].any()
            assert bool((tokens[int(ends[0]) + 1 :] == 0).all())
    assert out.tokens.shape[1] <= model.config.max_length


def test_empty_region_row_is_refused():
    model = build("updown")
    data = make_caption_set(2)
    with pytest.raises(ValueError, match="at least one real region"):
        greedy(model, data.features, torch.zeros_like(data.mask))


@pytest.mark.parametrize("decode", ["greedy", "beam", "sample"])
def test_live_captions_never_continue_with_pad_bos_or_unless_allowed_unk(decode):
    """A model that prefers `<pad>`, `<bos>` and `<unk>` above every word still writes words: the first two
    are not words, the third is kept out unless `suppress_unk=False` (where it then wins)."""
    model = build("updown")
    with torch.no_grad():
        model.output.bias[:4] += torch.tensor([30.0, 30.0, -30.0, 20.0])  # pad, bos, eos, unk
    data = make_caption_set(4)

    def tokens(suppress_unk: bool) -> torch.Tensor:
        if decode == "greedy":
            out = greedy(model, data.features, data.mask, suppress_unk=suppress_unk)
            return out.tokens[out.mask]
        if decode == "sample":
            generator = torch.Generator().manual_seed(0)
            out = sample(model, data.features, data.mask, generator=generator, suppress_unk=suppress_unk)
            return out.tokens[out.mask]
        beams = beam_search(model, data.features, data.mask, beam_size=3, suppress_unk=suppress_unk)
        steps = torch.arange(beams.tokens.shape[-1])
        return beams.tokens[steps < beams.lengths.unsqueeze(-1)]

    suppressed, allowed = tokens(True), tokens(False)
    assert not set(suppressed.tolist()) & {0, 1, 3} and suppressed.numel() > 0
    assert not set(allowed.tolist()) & {0, 1}
    assert (allowed == 3).float().mean() > 0.9  # with `<unk>` allowed the biased model writes little else


def test_unk_penalty_is_subtracted_from_unk_in_beam_scores_not_a_ban():
    """self-critical.pytorch's beam search: `<unk>` stays in the softmax and costs `unk_penalty` in
    log-prob per use. A model that strongly prefers `<unk>` still writes it under a small penalty, never
    under 1000; each beam's score is its teacher-forced log-probability (pad and bos excluded) less the
    penalty per `<unk>`."""
    model = build("updown")
    with torch.no_grad():
        model.output.bias[3] += 20.0  # <unk>
    data = make_caption_set(4)

    def live(beams) -> torch.Tensor:
        return torch.arange(beams.tokens.shape[-1]) < beams.lengths.unsqueeze(-1)

    def expected_scores(beams, penalty: float) -> torch.Tensor:
        words = beams.tokens.flatten(0, 1)
        inputs = torch.cat([torch.full((words.shape[0], 1), 1), words[:, :-1]], 1)  # <bos>, then the words
        with torch.no_grad():
            logits = model(
                input_ids=inputs,
                visual_feats=data.features.repeat_interleave(3, 0),
                visual_attention_mask=data.mask.repeat_interleave(3, 0),
            ).logits
        logp = torch.log_softmax(logits.index_fill(-1, torch.tensor([0, 1]), float("-inf")), dim=-1)
        chosen = logp.gather(-1, words.unsqueeze(-1)).squeeze(-1) - penalty * (words == 3)
        return (chosen * live(beams).flatten(0, 1)).sum(-1).view(beams.scores.shape)

    small = beam_search(model, data.features, data.mask, beam_size=3, unk_penalty=2.0)
    assert (small.tokens[live(small)] == 3).float().mean() > 0.5  # a penalty, not a ban
    large = beam_search(model, data.features, data.mask, beam_size=3, unk_penalty=1000.0)
    assert not (large.tokens[live(large)] == 3).any() and live(large).any()
    for beams, penalty in ((small, 2.0), (large, 1000.0)):
        torch.testing.assert_close(beams.scores, expected_scores(beams, penalty), rtol=1e-4, atol=1e-3)
    # the ban (no penalty given) renormalises without <unk>: higher scores than the penalty's
    banned = beam_search(model, data.features, data.mask, beam_size=3)
    assert (banned.scores > large.scores).all()
