"""The region inputs (global token, 5-d location) and the text embeddings with the task token."""

from __future__ import annotations

import torch

from model.vilbert.embeddings import TextEmbeddings, with_global_region


def test_global_token_is_the_mean_of_real_regions_at_the_whole_image():
    feats = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    boxes = torch.tensor([[[0.0, 0.0, 0.5, 0.5], [0.2, 0.4, 0.6, 0.9], [0.1, 0.1, 0.2, 0.2]]])
    mask = torch.tensor([[1, 1, 0]])
    out_feats, loc, out_mask = with_global_region(feats, boxes, mask)
    torch.testing.assert_close(out_feats[0, 0], torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(out_feats[0, 1:], feats[0])
    torch.testing.assert_close(loc[0, 0], torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))
    # (x1, y1, x2, y2, area of the normalised box = area / (W * H))
    torch.testing.assert_close(loc[0, 2], torch.tensor([0.2, 0.4, 0.6, 0.9, 0.4 * 0.5]))
    assert out_mask.tolist() == [[1, 1, 1, 0]]


def test_without_mask_every_region_is_real():
    feats = torch.randn(2, 4, 3)
    out_feats, _, mask = with_global_region(feats, torch.rand(2, 4, 4), None)
    torch.testing.assert_close(out_feats[:, 0], feats.mean(1))
    assert mask.all()


def test_task_token_goes_after_cls_without_position_or_type(vb):
    cfg = vb.small_config(task_vocab_size=4, task_token=2, hidden_dropout_prob=0.0)
    emb = vb.perturb(TextEmbeddings(cfg)).eval()
    ids = torch.tensor([[5, 6, 7]])
    out = emb(ids)
    assert out.shape == (1, 4, cfg.hidden_size)
    plain = (
        emb.word_embeddings(ids) + emb.position_embeddings.weight[:3] + emb.token_type_embeddings.weight[0]
    )
    expected = torch.cat([plain[:, :1], emb.task_embeddings.weight[2].view(1, 1, -1), plain[:, 1:]], dim=1)
    torch.testing.assert_close(out, emb.LayerNorm(expected))
