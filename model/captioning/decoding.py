"""Caption generation: greedy, sampled (for self-critical training) and batched beam search."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .captioner import Captioner


@dataclass
class Decoded:
    """One caption per image: tokens padded after `<eos>`, their log-probabilities and attention."""

    tokens: torch.Tensor  # (B, L) word ids, `<eos>` included when emitted, then `<pad>`
    logprobs: torch.Tensor  # (B, L) log p of each chosen token, 0 after `<eos>`
    attentions: torch.Tensor  # (B, L, N) attention over regions at each step
    mask: torch.Tensor  # (B, L) bool, True for the caption's tokens (`<eos>` included)


@dataclass
class Beams:
    """K captions per image, best first."""

    tokens: torch.Tensor  # (B, K, L)
    scores: torch.Tensor  # (B, K) summed log-probabilities divided by the length penalty
    attentions: torch.Tensor  # (B, K, L, N)
    lengths: torch.Tensor  # (B, K) tokens up to and including `<eos>`

    @property
    def best(self) -> torch.Tensor:
        return self.tokens[:, 0]


def never_emitted(cfg, suppress_unk: bool) -> list[int]:
    """Ids a live caption may not continue with: `<pad>` and `<bos>` (they are not words), and `<unk>`
    when `suppress_unk` (a caption of unknown words says nothing; self-critical.pytorch's suppress_UNK)."""
    ids = [cfg.pad_token_id, cfg.bos_token_id]
    if suppress_unk and cfg.unk_token_id is not None:
        ids.append(cfg.unk_token_id)
    return ids


def _rollout(
    model: Captioner,
    features: torch.Tensor,
    mask: torch.Tensor | None,
    max_length: int | None,
    sample: bool,
    temperature: float,
    generator: torch.Generator | None,
    suppress_unk: bool,
) -> Decoded:
    cfg = model.config
    banned = never_emitted(cfg, suppress_unk)
    max_length = max_length or cfg.max_length
    ctx = model.encode(features, mask)
    state = model.init_state(ctx)
    batch = features.shape[0]
    tokens = torch.full((batch,), cfg.bos_token_id, dtype=torch.long, device=features.device)
    done = torch.zeros(batch, dtype=torch.bool, device=features.device)
    chosen, logprobs, alphas, alive = [], [], [], []
    for _ in range(max_length):
        out = model.step(tokens, state, ctx)
        state = out.state
        logits = out.logits.index_fill(1, torch.tensor(banned, device=features.device), float("-inf"))
        logp = torch.log_softmax(logits, dim=-1)
        if sample:
            probs = torch.softmax(logits.detach() / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            tokens = logp.argmax(-1)
        tokens = tokens.masked_fill(done, cfg.pad_token_id)
        alive.append(~done)
        chosen.append(tokens)
        logprobs.append(logp.gather(1, tokens.unsqueeze(1)).squeeze(1).masked_fill(done, 0.0))
        alphas.append(out.alpha)
        done = done | (tokens == cfg.eos_token_id)
        if bool(done.all()):
            break
    return Decoded(
        torch.stack(chosen, 1), torch.stack(logprobs, 1), torch.stack(alphas, 1), torch.stack(alive, 1)
    )


@torch.no_grad()
def greedy(
    model: Captioner,
    features: torch.Tensor,
    mask: torch.Tensor | None = None,
    max_length: int | None = None,
    suppress_unk: bool = True,
) -> Decoded:
    """The most probable word at every step."""
    return _rollout(
        model,
        features,
        mask,
        max_length,
        sample=False,
        temperature=1.0,
        generator=None,
        suppress_unk=suppress_unk,
    )


def sample(
    model: Captioner,
    features: torch.Tensor,
    mask: torch.Tensor | None = None,
    max_length: int | None = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    suppress_unk: bool = False,
) -> Decoded:
    """Words drawn from the model; `logprobs` keep their graph for the policy gradient."""
    return _rollout(
        model,
        features,
        mask,
        max_length,
        sample=True,
        temperature=temperature,
        generator=generator,
        suppress_unk=suppress_unk,
    )


def length_penalty(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT's ((5 + |Y|) / 6)^α; α = 0 ranks by the summed log-probability."""
    return ((5.0 + lengths.to(torch.float32)) / 6.0) ** alpha


@torch.no_grad()
def beam_search(
    model: Captioner,
    features: torch.Tensor,
    mask: torch.Tensor | None = None,
    beam_size: int = 3,
    max_length: int | None = None,
    length_alpha: float = 0.0,
    suppress_unk: bool = True,
    unk_penalty: float | None = None,
) -> Beams:
    """Beam search over B·K rows at once; finished beams stay in the beam with their score frozen.
    With `suppress_unk`, `unk_penalty` None bans `<unk>`; a number is subtracted from its log-prob
    instead, as self-critical.pytorch's beam search does (1000)."""
    cfg = model.config
    penalise = suppress_unk and unk_penalty is not None and cfg.unk_token_id is not None
    banned = torch.tensor(never_emitted(cfg, suppress_unk and not penalise), device=features.device)
    max_length = max_length or cfg.max_length
    batch, k, device = features.shape[0], beam_size, features.device
    ctx = model.encode(features, mask)
    rows = torch.arange(batch, device=device).repeat_interleave(k)
    ctx = ctx.select(rows)
    state = model.init_state(ctx)
    # Only the first beam of each image is live at the start, so the first step picks K distinct words.
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    tokens = torch.full((batch * k,), cfg.bos_token_id, dtype=torch.long, device=device)
    done = torch.zeros(batch * k, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch * k, dtype=torch.long, device=device)
    history = torch.empty(batch * k, 0, dtype=torch.long, device=device)
    attn_history = torch.empty(batch * k, 0, ctx.mask.shape[1], device=device)
    offsets = (torch.arange(batch, device=device) * k).unsqueeze(1)
    for _ in range(max_length):
        out = model.step(tokens, state, ctx)
        logp = torch.log_softmax(out.logits.float().index_fill(1, banned, float("-inf")), dim=-1)
        if penalise:
            logp[:, cfg.unk_token_id] -= unk_penalty
        vocab = logp.shape[-1]
        # A finished beam extends only by `<pad>` at no cost, so it keeps its place and score.
        frozen = torch.full_like(logp, float("-inf"))
        frozen[:, cfg.pad_token_id] = 0.0
        logp = torch.where(done.unsqueeze(1), frozen, logp)
        candidates = (scores.unsqueeze(-1) + logp.view(batch, k, vocab)).view(batch, k * vocab)
        scores, flat = candidates.topk(k, dim=-1)
        origin = (torch.div(flat, vocab, rounding_mode="floor") + offsets).view(-1)
        tokens = (flat % vocab).view(-1)
        state = tuple(s.index_select(0, origin) for s in out.state)
        done = done.index_select(0, origin)
        lengths = lengths.index_select(0, origin) + (~done).long()
        history = torch.cat([history.index_select(0, origin), tokens.unsqueeze(1)], 1)
        attn_history = torch.cat(
            [attn_history.index_select(0, origin), out.alpha.index_select(0, origin).unsqueeze(1)], 1
        )
        done = done | (tokens == cfg.eos_token_id)
        if bool(done.all()):
            break
    lengths = lengths.view(batch, k)
    ranked = scores / length_penalty(lengths, length_alpha)
    ranked, order = ranked.sort(dim=-1, descending=True)
    pick = (order + offsets).view(-1)
    steps = history.shape[1]
    return Beams(
        history.index_select(0, pick).view(batch, k, steps),
        ranked,
        attn_history.index_select(0, pick).view(batch, k, steps, -1),
        lengths.view(-1).index_select(0, pick).view(batch, k),
    )
