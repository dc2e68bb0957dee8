"""The Up-Down captioner (Anderson et al. 2018): an attention LSTM and a language LSTM over regions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AdditiveAttention
from .captioner import Captioner, Context, State, StepOutput
from .config import CaptionConfig
from .lstm import cell_bias, input_gates, lstm_update, recurrent_weight


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

    def unroll(self, ctx: Context, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` over all words, with the words' and mean feature's gate inputs projected once."""
        hidden, dim = self.config.hidden_size, self.config.visual_feat_dim
        att, lang = self.attention_lstm, self.language_lstm
        # Attention LSTM input columns: [h_lang (H) | mean (D) | word (E)].
        fixed = input_gates(att, self.embed(inputs), hidden + dim, att.weight_ih.shape[1])
        fixed = fixed + (input_gates(att, ctx.mean, hidden, hidden + dim) + cell_bias(att)).unsqueeze(1)
        att_weight = torch.cat([att.weight_ih[:, :hidden], att.weight_hh], dim=1)  # [h_lang ; h_att]
        lang_weight = recurrent_weight(lang, 0, lang.weight_ih.shape[1])  # [attended ; h_att ; h_lang]
        lang_bias = cell_bias(lang)
        h_att, c_att, h_lang, c_lang = self.init_state(ctx)
        outputs, alphas = [], []
        for t in range(inputs.shape[1]):
            gates = fixed[:, t] + F.linear(torch.cat([h_lang, h_att], dim=-1), att_weight)
            h_att, c_att = lstm_update(gates, c_att)
            alpha = self.attention(h_att, ctx.keys, ctx.mask)
            attended = torch.bmm(alpha.unsqueeze(1), ctx.features).squeeze(1)
            gates = F.linear(torch.cat([attended, h_att, h_lang], dim=-1), lang_weight, lang_bias)
            h_lang, c_lang = lstm_update(gates, c_lang)
            outputs.append(h_lang)
            alphas.append(alpha)
        return self.output(self.dropout(torch.stack(outputs, 1))), torch.stack(alphas, 1)
