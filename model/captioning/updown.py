"""The Up-Down captioner (Anderson et al. 2018): an attention LSTM and a language LSTM over regions."""

from __future__ import annotations

import torch
from torch import nn

from .attention import AdditiveAttention
from .captioner import Captioner, Context, State, StepOutput
from .config import CaptionConfig


class UpDownCaptioner(Captioner):
    """Top-down attention over bottom-up regions, driven by a two-LSTM decoder."""

    def __init__(self, config: CaptionConfig):
        super().__init__(config)
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.embed_size, padding_idx=c.pad_token_id)
        # Attention LSTM input: previous language-LSTM h, the mean region feature, the previous word.
        self.attention_lstm = nn.LSTMCell(c.hidden_size + c.visual_feat_dim + c.embed_size, c.hidden_size)
        self.attention = AdditiveAttention(c.visual_feat_dim, c.hidden_size, c.attention_size)
        # Language LSTM input: the attended feature and the attention-LSTM h.
        self.language_lstm = nn.LSTMCell(c.visual_feat_dim + c.hidden_size, c.hidden_size)
        self.dropout = nn.Dropout(c.dropout)
        self.output = nn.Linear(c.hidden_size, c.vocab_size)

    def init_state(self, ctx: Context) -> State:
        zeros = ctx.mean.new_zeros(ctx.mean.shape[0], self.config.hidden_size)
        return (zeros, zeros, zeros, zeros)

    def step(self, tokens: torch.Tensor, state: State, ctx: Context) -> StepOutput:
        h_att, c_att, h_lang, c_lang = state
        x = torch.cat([h_lang, ctx.mean, self.embed(tokens)], dim=-1)
        h_att, c_att = self.attention_lstm(x, (h_att, c_att))
        alpha = self.attention(h_att, ctx.keys, ctx.mask)
        attended = torch.bmm(alpha.unsqueeze(1), ctx.features).squeeze(1)
        h_lang, c_lang = self.language_lstm(torch.cat([attended, h_att], dim=-1), (h_lang, c_lang))
        logits = self.output(self.dropout(h_lang))
        return StepOutput(logits, (h_att, c_att, h_lang, c_lang), alpha)
