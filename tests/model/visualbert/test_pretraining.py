"""VisualBERT pre-training: logits and losses equal to transformers' `VisualBertForPreTraining`."""

from __future__ import annotations

import pytest
import torch

from model.visualbert import VisualBertForPreTraining

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(vb):
    cfg = vb.small_config()
    torch.manual_seed(0)
    hf = transformers.VisualBertForPreTraining(vb.hf_config(cfg)).eval()
    vb.perturb(hf)
    ours = VisualBertForPreTraining(cfg).eval()
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("cls.predictions.decoder")}
    ours.load_state_dict(state, strict=True)
    return cfg, hf, ours


def test_logits_and_losses_match_transformers(pair, vb):
    cfg, hf, ours = pair
    inputs = vb.make_inputs(cfg)
    lm = torch.full_like(inputs["input_ids"], -100)
    lm[0, 2], lm[1, 1], lm[2, 5] = 4, 9, 17
    matched = torch.tensor([1, 0, 1])
    hf_labels = torch.cat([lm, torch.full((3, 5), -100)], 1)  # transformers labels the whole sequence
    with torch.no_grad():
        ref = hf(**vb.hf_inputs(inputs), labels=hf_labels, sentence_image_labels=matched)
        out = ours(**inputs, lm_labels=lm, matched_labels=matched)
        bare = ours(**inputs)
    picked = lm != -100
    torch.testing.assert_close(out.lm_logits, ref.prediction_logits[:, :7][picked], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bare.lm_logits, ref.prediction_logits[:, :7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.matched_logits, ref.seq_relationship_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert set(out.losses) == {"mlm", "matched"}


def test_labels_at_padding_count_for_nothing(pair, vb):
    cfg, _, ours = pair
    inputs = vb.make_inputs(cfg)
    lm = torch.full_like(inputs["input_ids"], -100)
    lm[0, 2] = 4
    with torch.no_grad():
        base = ours(**inputs, lm_labels=lm).loss
        lm[1, -1] = 5  # row 1's last token is padding
        assert torch.equal(ours(**inputs, lm_labels=lm).loss, base)


def test_decoder_is_tied_to_the_word_table(pair, vb):
    cfg, _, ours = pair
    model = VisualBertForPreTraining(cfg)
    inputs = vb.make_inputs(cfg)
    lm = torch.full_like(inputs["input_ids"], -100)
    lm[:, 1] = 3
    model(**inputs, lm_labels=lm).loss.backward()
    word = model.visual_bert.embeddings.word_embeddings.weight
    assert word.grad[3].abs().sum() > 0  # the decoder row of the target word gets a gradient
