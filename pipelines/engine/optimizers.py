"""The optimizers `train.optimizer` names: the LXMERT release's BertAdam, torch's AdamW, and SGD with
momentum (detectron2's solver)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

BERTADAM_EPS = 1e-6  # the release's default `e`
# pytorch-pretrained-bert's BertAdam clips every parameter's gradient to a norm of its own (its default 1.0),
# after and besides the trainer's clip of all gradients together (train.clip_norm); LXMERT's copy of it
# (src/lxrt/optimization.py) leaves that clip out, as the gradient "is clipped outside": 0 (<= 0: none)
BERTADAM_MAX_GRAD_NORM = 0.0
ADAMW_EPS = 1e-8  # torch's default
SGD_MOMENTUM = 0.9  # detectron2's SOLVER.MOMENTUM
# BertAdam updates this many elements per list operation: its two temporaries (sqrt(v) + eps and the
# update) hold 2 x 64 MiB in float32 at most, beside one parameter's worth in the per-parameter loop
FOREACH_CHUNK = 2**24
OPTIMIZERS = ("bertadam", "adamw", "sgd")


class BertAdam(torch.optim.Optimizer):
    """Adam as the LXMERT release's `BertAdam` (pytorch-pretrained-bert's) steps: no bias correction,
    epsilon added to sqrt(v), and weight decay added to the update (decoupled from the moments) before it is
    scaled by the learning rate; with `max_grad_norm` > 0 (pytorch-pretrained-bert's 1.0; LXMERT's copy has
    none) each parameter's gradient is first clipped to that norm on its own:

        m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  p <- p - lr (m / (sqrt(v) + eps) + wd p)

    with the release's roundings: `wd p` and `lr (...)` are products rounded before they are added. The
    learning-rate schedule (the release's warm-up-linear) is the trainer's scheduler, which sets `lr`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = BERTADAM_EPS,
        weight_decay: float = 0.01,
        max_grad_norm: float = BERTADAM_MAX_GRAD_NORM,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"BertAdam needs lr, eps, weight_decay >= 0 and betas in [0, 1): got lr={lr}, eps={eps}, "
                f"weight_decay={weight_decay}, betas={betas}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, {**defaults, "max_grad_norm": max_grad_norm})

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # a state saved before the setting existed: LXMERT's (no clip)
            group.setdefault("max_grad_norm", BERTADAM_MAX_GRAD_NORM)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("BertAdam does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for chunk in _chunks(params, FOREACH_CHUNK):
                self._update(group, chunk)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        """The rule's operations, each over the whole list at once (torch._foreach_*: a few kernel launches
        on CUDA, the one-tensor kernels on a CPU), in the one-parameter order and with its intermediate
        results, so the same bits come out."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        if group["max_grad_norm"] > 0:
            # clip_grad_norm_(p, max_norm) for each p: its total norm is the norm of one norm, the
            # coefficient max_norm / (norm + 1e-6) at most 1, the gradient scaled in place
            norms = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))[:, None], dim=1)
            scale = torch.clamp(group["max_grad_norm"] / (norms + 1e-6), max=1.0)
            torch._foreach_mul_(grads, list(scale.unbind()))
        states = [self.state[p] for p in params]
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, grads, alpha=1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(m, denom)
        del denom
        if group["weight_decay"] > 0:  # update += wd * p: the product rounded, then the sum
            decay = torch._foreach_mul(params, group["weight_decay"])
            torch._foreach_add_(update, decay)
            del decay
        # p += -(lr * update): the product rounded, then the sum (lr * x and -lr * x differ in sign alone)
        torch._foreach_mul_(update, -group["lr"])
        torch._foreach_add_(params, update)
        torch._foreach_add_([s["step"] for s in states], 1.0)


def _chunks(params: list[torch.Tensor], limit: int) -> Iterable[list[torch.Tensor]]:
    """`params` in consecutive runs of at most `limit` elements (a larger tensor alone): the update's
    temporaries stay that small."""
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        if chunk and size + p.numel() > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


def build_optimizer(
    name: str,
    groups: list[dict],
    lr: float,
    weight_decay: float,
    *,
    momentum: float = SGD_MOMENTUM,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer `name` over parameter `groups` (each may carry its own weight_decay); `momentum` is
    SGD's (its weight decay is L2 added to the gradient, not decoupled, as in detectron2). `fused`: AdamW
    updates every parameter in one fused kernel (CUDA parameters; the trainer asks for it there)."""
    if name == "bertadam":
        return BertAdam(groups, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, eps=ADAMW_EPS, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {list(OPTIMIZERS)}")
