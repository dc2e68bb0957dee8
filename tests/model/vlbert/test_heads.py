"""VL-BERT's VQA head (answer segment, [MASK] read-out, BCE x A) and NLVR2 pair head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.vlbert import VlBertForNLVR2, VlBertForQuestionAnswering
from model.vlbert.heads import with_answer_segment


def test_answer_segment_follows_each_question():
    ids = torch.tensor([[1, 7, 8, 2], [1, 9, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    new_ids, new_mask, types, at = with_answer_segment(ids, mask, None, mask_token_id=3, sep_token_id=2)
    assert new_ids.tolist() == [[1, 7, 8, 2, 3, 2], [1, 9, 2, 3, 2, 0]]
    assert new_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    assert types.tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 0]]
    assert at.tolist() == [4, 3]
    assert ids.tolist() == [[1, 7, 8, 2], [1, 9, 2, 0]]  # inputs untouched


def test_question_answering_reads_the_mask_token(vl):
    cfg = vl.small_config()
    torch.manual_seed(0)
    model = VlBertForQuestionAnswering(cfg, num_answers=6).eval()
    vl.wake(model)
    inputs = vl.make_inputs(cfg)
    labels = (torch.rand(3, 6) > 0.7).float() * torch.rand(3, 6)
    with torch.no_grad():
        out = model(**inputs, labels=labels, output_attentions=True)
        ids, mask, types, at = with_answer_segment(
            inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"], 3, 2
        )
        states = model.vlbert(
            ids, mask, types, inputs["visual_feats"], inputs["visual_pos"], inputs["visual_attention_mask"]
        ).text_output
        expected = model.final_mlp(states[torch.arange(3), at])
    torch.testing.assert_close(out.logits, expected)
    assert torch.allclose(out.loss, F.binary_cross_entropy_with_logits(expected, labels) * 6)
    assert out.region_attention.shape == (3, 5)
    assert not out.region_attention[-1, -2:].any()  # padded regions get no weight
    assert [type(m).__name__ for m in model.final_mlp] == ["PredictionTransform", "Dropout", "Linear"]


def test_nlvr2_pairs(vl):
    cfg = vl.small_config()
    model = VlBertForNLVR2(cfg)
    inputs = vl.make_inputs(cfg, batch=2)
    pair = {
        **inputs,
        "visual_feats": torch.randn(2, 2, 5, cfg.visual_feat_dim),
        "visual_pos": torch.rand(2, 2, 5, 4),
        "visual_attention_mask": torch.ones(2, 2, 5),
    }
    out = model(**pair, labels=torch.tensor([1, 0]))
    assert out.logits.shape == (2, 2) and out.loss.ndim == 0
    out.loss.backward()
    assert model.vlbert.word_embeddings.weight.grad is not None
    pair["visual_attention_mask"][1, 0, -1] = 0
    with torch.no_grad():
        attention = model(**pair, output_attentions=True).region_attention
    assert attention.shape == (2, 2, 5) and attention[1, 0, -1] == 0 and (attention >= 0).all()
    with pytest.raises(ValueError, match=r"\(B, 2, N, D\)"):
        model(**inputs)


def test_tiny_model_learns_answers_from_the_regions(vl):
    """The answer is written into one random region's features: only the visual path can tell it."""
    torch.manual_seed(0)
    cfg = vl.small_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, visual_dropout_prob=0.0)
    model = VlBertForQuestionAnswering(cfg, num_answers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(n: int) -> tuple[dict, torch.Tensor]:
        inputs = vl.make_inputs(cfg, batch=n, tokens=5, boxes=3, seed=int(torch.randint(0, 10**6, ())))
        answers = torch.randint(0, 4, (n,))
        feats = torch.randn(n, 3, cfg.visual_feat_dim) * 0.1
        feats[torch.arange(n), torch.randint(0, 3, (n,)), :4] += 3 * F.one_hot(answers, 4)
        inputs |= {"visual_feats": feats, "visual_attention_mask": torch.ones(n, 3)}
        return inputs, answers

    for _ in range(60):
        inputs, answers = batch(16)
        loss = model(**inputs, labels=F.one_hot(answers, 4).float()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    inputs, answers = batch(200)
    with torch.no_grad():
        accuracy = (model(**inputs).logits.argmax(-1) == answers).float().mean()
    assert accuracy > 0.9  # chance is 0.25
