"""The optimizers `train.optimizer` names: the LXMERT release's BertAdam, torch's AdamW, and SGD with
momentum (detectron2's solver)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

BERTADAM_EPS = 1e-6  # the release's default `e`
ADAMW_EPS = 1e-8  # torch's default
SGD_MOMENTUM = 0.9  # detectron2's SOLVER.MOMENTUM
OPTIMIZERS = ("bertadam", "adamw", "sgd")


class BertAdam(torch.optim.Optimizer):
    """Adam as the LXMERT release's `BertAdam` steps: no bias correction, epsilon added to sqrt(v), and
    weight decay added to the update (decoupled from the moments) before it is scaled by the learning rate:

        m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  p <- p - lr (m / (sqrt(v) + eps) + wd p)

    The learning-rate schedule (the release's warm-up-linear) is the trainer's scheduler, which sets `lr`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = BERTADAM_EPS,
        weight_decay: float = 0.01,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"BertAdam needs lr, eps, weight_decay >= 0 and betas in [0, 1): got lr={lr}, eps={eps}, "
                f"weight_decay={weight_decay}, betas={betas}"
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("BertAdam does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = m / (v.sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                state["step"] += 1
        return loss


def build_optimizer(
    name: str, groups: list[dict], lr: float, weight_decay: float, *, momentum: float = SGD_MOMENTUM
) -> torch.optim.Optimizer:
    """The optimizer `name` over parameter `groups` (each may carry its own weight_decay); `momentum` is
    SGD's (its weight decay is L2 added to the gradient, not decoupled, as in detectron2)."""
    if name == "bertadam":
        return BertAdam(groups, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, eps=ADAMW_EPS)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {list(OPTIMIZERS)}")
