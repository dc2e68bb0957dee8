"""The discrete VAE: shapes, the paper's relaxation, likelihood, KL and annealing, and a round trip."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, Laplace, kl_divergence

from model.dalle import DiscreteVAE, DVAEConfig, cosine_anneal, gumbel_softmax, logit_laplace_nll

TINY = {"image_size": 16, "codebook_size": 13, "hidden_size": 8, "blocks_per_group": 1, "downsample": 4}


def test_encoder_and_decoder_shapes_follow_the_downsampling():
    torch.manual_seed(0)
    model = DiscreteVAE(DVAEConfig.preset("small", **TINY))
    images = torch.rand(2, 3, 16, 16)
    out = model(images, temperature=1.0, kl_weight=1.0)
    assert out.logits.shape == (2, 13, 4, 4)
    assert out.reconstruction.shape == images.shape
    assert out.reconstruction.min() >= 0 and out.reconstruction.max() <= 1
    tokens = model.encode(images)
    assert tokens.shape == (2, 4, 4) and tokens.dtype == torch.long and tokens.max() < 13
    assert model.decode(tokens).shape == images.shape


def test_the_papers_shapes_give_32_by_32_tokens_of_8192():
    cfg = DVAEConfig.preset("paper")
    assert (cfg.image_size, cfg.codebook_size, cfg.grid_size, cfg.num_groups) == (256, 8192, 32, 4)
    with torch.device("meta"):
        logits = DiscreteVAE(cfg).encoder(torch.empty(1, 3, 256, 256))
    assert logits.shape == (1, 8192, 32, 32)


def test_relaxation_is_softmax_of_logits_plus_gumbel_noise_over_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 3, 3, generator=g)
    u = torch.rand(logits.shape, generator=g)
    noise = -torch.log(-torch.log(u))
    tau = 0.3
    weights = torch.exp((logits + noise) / tau)
    expected = weights / weights.sum(dim=1, keepdim=True)
    assert torch.allclose(gumbel_softmax(logits, tau, dim=1, noise=noise), expected, atol=1e-6)
    # a scaled noise, and none at all (the small preset's deterministic relaxation)
    weights = torch.exp((logits + 0.25 * noise) / tau)
    expected = weights / weights.sum(dim=1, keepdim=True)
    scaled = gumbel_softmax(logits, tau, dim=1, noise=noise, noise_scale=0.25)
    assert torch.allclose(scaled, expected, atol=1e-6)
    weights = torch.exp(logits / tau)
    plain = weights / weights.sum(dim=1, keepdim=True)
    assert torch.allclose(gumbel_softmax(logits, tau, dim=1, noise_scale=0.0), plain, atol=1e-6)


def test_the_training_relaxation_uses_the_configured_noise_and_logit_scale():
    """The forward pass relaxes `logit_scale` x the encoder's output: with no noise, two calls agree and
    equal softmax(scaled logits / tau) decoded; with noise they differ."""
    torch.manual_seed(0)
    images = torch.rand(2, 3, 16, 16)
    base = DiscreteVAE(DVAEConfig.preset("small", **TINY, logit_scale=1.0, gumbel_noise=0.0)).eval()
    scaled = DiscreteVAE(DVAEConfig.preset("small", **TINY, logit_scale=10.0, gumbel_noise=0.0)).eval()
    scaled.load_state_dict(base.state_dict())
    out = scaled(images, temperature=0.5, kl_weight=0.0)
    assert torch.allclose(out.logits, 10.0 * base(images, temperature=0.5, kl_weight=0.0).logits, atol=1e-5)
    z = torch.softmax(out.logits / 0.5, dim=1)
    assert torch.allclose(out.reconstruction, scaled.pixels(scaled.decoder(z)), atol=1e-6)
    assert torch.equal(out.reconstruction, scaled(images, temperature=0.5, kl_weight=0.0).reconstruction)
    noisy = DiscreteVAE(DVAEConfig.preset("small", **TINY, gumbel_noise=1.0)).eval()
    noisy.load_state_dict(base.state_dict())
    a, b = (noisy(images, temperature=0.5, kl_weight=0.0).reconstruction for _ in range(2))
    assert not torch.allclose(a, b)


def test_relaxed_samples_are_distributed_as_the_encoders_categorical():
    """Gumbel-max: at a low temperature the relaxed sample's argmax follows softmax(logits)."""
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    draws = gumbel_softmax(logits.expand(20000, 4), 1 / 16, dim=1)
    assert torch.allclose(draws.sum(1), torch.ones(20000))
    frequency = torch.bincount(draws.argmax(1), minlength=4) / 20000
    assert torch.allclose(frequency, logits.softmax(0), atol=0.015)


def test_logit_laplace_nll_matches_the_density_written_out():
    """y = (1 - 2 eps) x + eps; logit(y) ~ Laplace(mu, b), so p(y) = Laplace density / (y (1 - y))."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 4, 4, generator=g)
    stats = torch.randn(2, 6, 4, 4, generator=g)
    eps = 0.1
    y = (1 - 2 * eps) * x + eps
    mu, b = stats[:, :3], stats[:, 3:].exp()
    expected = -(Laplace(mu, b).log_prob(torch.log(y / (1 - y))) - torch.log(y * (1 - y)))
    assert torch.allclose(logit_laplace_nll(x, stats, eps), expected, atol=1e-5)


@pytest.mark.parametrize("reconstruction", ["logit-laplace", "mse"])
def test_loss_is_nll_plus_beta_kl_against_the_uniform_prior_per_pixel_value(reconstruction):
    torch.manual_seed(0)
    cfg = DVAEConfig.preset("small", **TINY, reconstruction_loss=reconstruction)
    model = DiscreteVAE(cfg)
    images = torch.rand(3, 3, 16, 16)
    out = model(images, temperature=0.5, kl_weight=2.5)
    q = Categorical(logits=out.logits.permute(0, 2, 3, 1))
    uniform = Categorical(logits=torch.zeros(cfg.codebook_size))
    kl = kl_divergence(q, uniform)  # (B, h, w)
    assert torch.allclose(out.kl, kl.mean(), atol=1e-5)
    if reconstruction == "mse":
        assert torch.allclose(out.reconstruction_nll, F.mse_loss(out.reconstruction, images))
    pixel_values = 3 * 16 * 16
    expected = (out.reconstruction_nll * pixel_values * 3 + 2.5 * kl.sum()) / (3 * pixel_values)
    assert torch.allclose(out.loss, expected, atol=1e-5)


def test_annealing_follows_the_papers_endpoints():
    """Temperature 1 -> 1/16 over 150k updates, KL weight 0 -> 6.6 over 5k, both cosine then held."""
    model_cfg = DVAEConfig.preset("paper")
    with torch.device("meta"):
        model = DiscreteVAE(model_cfg)
    assert model.schedule(0) == (1.0, 0.0)
    tau, beta = model.schedule(5_000)
    assert beta == pytest.approx(6.6) and 1 / 16 < tau < 1
    assert model.schedule(150_000)[0] == pytest.approx(1 / 16)
    assert model.schedule(10**6) == (pytest.approx(1 / 16), pytest.approx(6.6))
    half = 0.5 * (1 + math.cos(math.pi * 0.5))
    assert model.schedule(75_000)[0] == pytest.approx(1 / 16 + (1 - 1 / 16) * half)
    taus = [cosine_anneal(s, 1.0, 1 / 16, 100) for s in range(0, 120, 5)]
    assert all(a >= b for a, b in zip(taus, taus[1:], strict=False))


def test_decoding_a_grid_of_tokens_is_its_one_hot_relaxation_at_zero_temperature():
    """`decode` and the training path meet: a one-hot z through the decoder is what `decode` returns."""
    torch.manual_seed(0)
    model = DiscreteVAE(DVAEConfig.preset("small", **TINY)).eval()
    tokens = torch.randint(0, 13, (2, 4, 4))
    one_hot = F.one_hot(tokens, 13).permute(0, 3, 1, 2).float()
    assert torch.allclose(model.decode(tokens), model.pixels(model.decoder(one_hot)))


@pytest.mark.parametrize(
    ("relaxation", "lr"),
    [({}, 1e-3), ({"gumbel_noise": 1.0}, 1e-3), ({"gumbel_noise": 1.0, "logit_scale": 1.0}, 3e-3)],
    ids=["small-preset", "gumbel-noise", "gumbel-noise-unscaled-logits"],
)
def test_training_a_few_steps_makes_reconstructions_recover_the_image(relaxation, lr):
    """Round trip: after training on four flat-colour quadrant images, encode -> decode recovers them,
    with the small preset's relaxation (no noise, scaled logits) and with the paper's Gumbel noise."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = DVAEConfig.preset(
        "small",
        **{**TINY, "hidden_size": 16, "temperature_anneal_steps": 150, "kl_anneal_steps": 50, **relaxation},
        reconstruction_loss="mse",
        kl_weight=0.1,
    )
    model = DiscreteVAE(cfg)
    colours = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.8, 0.2], [0.1, 0.2, 0.9], [0.9, 0.9, 0.1]])
    images = torch.zeros(4, 3, 16, 16)
    for i in range(4):
        images[i, :, :8, :8] = colours[i, :, None, None]
        images[i, :, 8:, 8:] = colours[(i + 1) % 4, :, None, None]
        images[i, :, :8, 8:] = colours[(i + 2) % 4, :, None, None]
        images[i, :, 8:, :8] = 0.5
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(200):
        tau, beta = model.schedule(step)
        loss = model(images, tau, beta).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    model.eval()
    mse = F.mse_loss(model.decode(model.encode(images)), images)
    psnr = 10 * torch.log10(1 / mse)
    # A decoder that ignores the codes reaches about 11 dB here (the per-pixel mean).
    assert psnr > 15, f"round-trip PSNR {psnr:.1f} dB"
