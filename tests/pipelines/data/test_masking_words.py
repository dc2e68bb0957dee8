"""Whole-word masking: a word's WordPiece pieces are picked, and share their fate, together."""

from __future__ import annotations

import numpy as np

from pipelines.data.masking import mask_words


def test_pieces_of_a_word_are_masked_together():
    # [CLS] play ##ing foot ##ball ##er is [SEP] [PAD]
    ids = np.array([[1, 10, 11, 12, 13, 14, 15, 2, 0]] * 200)
    continues = np.array([[0, 0, 1, 0, 1, 1, 0, 0, 0]] * 200, dtype=bool)
    maskable = np.array([[0, 1, 1, 1, 1, 1, 1, 0, 0]] * 200, dtype=bool)
    out, labels = mask_words(ids, maskable, continues, np.random.default_rng(0), 50, 3, prob=0.3)
    picked = labels != -100
    assert (picked[:, 1] == picked[:, 2]).all()
    assert (picked[:, 3] == picked[:, 4]).all() and (picked[:, 4] == picked[:, 5]).all()
    assert not picked[:, [0, 7, 8]].any()
    masked = out == 3
    assert (masked[:, 3] == masked[:, 4]).all()  # one fate per word
    assert 0.2 < picked[:, 3].mean() < 0.4  # words picked with the given probability
    assert (labels[picked] == ids[picked]).all()
