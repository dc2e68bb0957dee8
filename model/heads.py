"""Output heads: pooler, masked-LM, object/attribute/feature prediction, and the MLP classifier head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LxmertConfig


class Pooler(nn.Module):
    """`tanh(W h[CLS])`."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, lang: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(lang[:, 0]))


class Transform(nn.Module):
    """`LN(gelu(W h))`, the shared first step of the prediction heads."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x)))


class _TiedDecoder(torch.autograd.Function):
    """`x @ W.T + b` whose backward hands autograd a fresh contiguous gradient for W.

    W is also the word-embedding table, so autograd sums two (vocab, hidden) gradients for it. It adds
    in place into a buffer it owns alone; `F.linear`'s weight gradient is a transposed view, which
    makes it allocate a third 94 MB buffer (at the base size) on every step instead.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        # Under autocast the forward ran in x's dtype; autograd casts the returned grads back.
        grad = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad @ weight.to(grad.dtype)).view(x.shape)
        return grad_x, grad.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype), grad.sum(0)


class MaskedLMHead(nn.Module):
    """Vocabulary logits through the word-embedding matrix (tied, passed at call time) plus a bias."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.transform = Transform(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return _TiedDecoder.apply(self.transform(x), word_embeddings, self.bias)


class ObjectHead(nn.Module):
    """Per-object detector label, attribute and original-feature predictions."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.transform = Transform(cfg)
        self.obj = nn.Linear(cfg.hidden_size, cfg.num_object_labels)
        self.attr = nn.Linear(cfg.hidden_size, cfg.num_attr_labels)
        self.feat = nn.Linear(cfg.hidden_size, cfg.visual_feat_dim)


class ClassifierHead(nn.Module):
    """`Linear(in, hidden) -> GELU -> LN -> Linear(hidden, out)`: the QA answer and NLVR2 pair head."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_dim, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.classifier = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(F.gelu(self.dense(x))))
