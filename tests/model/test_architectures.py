"""Every family in FAMILIES: each preset builds every role with stable names; each role round-trips and runs.

Families share a contract: configs with `PRESETS`, `preset`, `from_dict`, `to_dict`, `vocab_size` and
`visual_feat_dim`; roles built as `cls(config)` (`num_answers=` for "qa"); heads take the same inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import FAMILIES, ClassificationOutput, architecture_class, family_of, get_family

PRESETS = [(family, preset) for family, f in FAMILIES.items() for preset in f.config_class.PRESETS]
ROLES = [(family, role) for family, f in FAMILIES.items() for role in f.models]
NUM_ANSWERS = 3


def _build(family: str, role: str, cfg):
    cls = FAMILIES[family].models[role]
    return cls(cfg, num_answers=NUM_ANSWERS) if role == "qa" else cls(cfg)


def _shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


@pytest.mark.parametrize(("family", "preset"), PRESETS)
def test_every_preset_builds_every_role_with_stable_names(family, preset):
    """Built on the meta device, so the released sizes cost no memory or time."""
    cfg = FAMILIES[family].config_class.preset(preset)
    with torch.device("meta"):
        backbone = _shapes(FAMILIES[family].models["backbone"](cfg))
        for role in FAMILIES[family].models:
            first, second = _shapes(_build(family, role, cfg)), _shapes(_build(family, role, cfg))
            assert first == second, role
            prefix = FAMILIES[family].models[role].base_model_prefix
            # the backbone sits whole under base_model_prefix, so any role loads any other's backbone
            inner = [(k[len(prefix) :], s) for k, s in first if k.startswith(prefix)]
            assert (inner if prefix else inner[: len(backbone)]) == backbone, role


def _smallest_preset(family: str):
    config_class = FAMILIES[family].config_class

    def size(name: str) -> int:
        with torch.device("meta"):
            backbone = FAMILIES[family].models["backbone"](config_class.preset(name))
        return sum(p.numel() for p in backbone.parameters())

    return config_class.preset(min(config_class.PRESETS, key=size))


def _inputs(cfg, role: str, batch: int = 2, tokens: int = 5, regions: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    images = (batch, 2, regions) if role == "nlvr2" else (batch, regions)
    corners = torch.rand(*images, 2, 2, generator=g).sort(dim=-2).values  # x1 <= x2, y1 <= y2
    visual_mask = torch.ones(images)
    visual_mask[-1, ..., -1] = 0
    text_mask = torch.ones(batch, tokens, dtype=torch.long)
    text_mask[0, -2:] = 0
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, tokens), generator=g),
        "attention_mask": text_mask,
        "token_type_ids": torch.zeros(batch, tokens, dtype=torch.long),
        "visual_feats": torch.randn(*images, cfg.visual_feat_dim, generator=g),
        "visual_pos": corners.transpose(-1, -2).flatten(-2),
        "visual_attention_mask": visual_mask,
    }


# Families that take no regions (DALL-E's two stages): their inputs, from the config.
PIXEL_AND_TOKEN_INPUTS = {
    "dalle-dvae": lambda cfg: {
        "images": torch.rand(2, cfg.channels, cfg.image_size, cfg.image_size),
        "temperature": 1.0,
        "kl_weight": 1.0,
    },
    "dalle": lambda cfg: {
        "text": torch.randint(0, cfg.text_vocab_size, (2, cfg.text_length)),
        "image": torch.randint(0, cfg.image_vocab_size, (2, cfg.image_length)),
    },
}


@pytest.mark.parametrize(("family", "role"), ROLES)
def test_every_role_round_trips_and_runs(family, role, tmp_path):
    torch.manual_seed(0)
    cfg = _smallest_preset(family)
    model = _build(family, role, cfg).eval()
    loaded = type(model).from_pretrained(model.save_pretrained(tmp_path / role)).eval()
    assert loaded.config == model.config and loaded.init_kwargs() == model.init_kwargs()
    saved, again = model.state_dict(), loaded.state_dict()
    assert list(saved) == list(again)
    assert all(torch.equal(saved[k], again[k]) for k in saved)

    if family in PIXEL_AND_TOKEN_INPUTS:
        with torch.no_grad():
            out = loaded(**PIXEL_AND_TOKEN_INPUTS[family](cfg))
        assert all(torch.isfinite(v).all() for v in vars(out).values())
        return
    inputs = _inputs(cfg, role)
    with torch.no_grad():
        out = loaded(**inputs, output_attentions=True)
    tensors = [v for v in vars(out).values() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.isfinite(t).all() for t in tensors)
    if role in ("qa", "nlvr2"):
        assert isinstance(out, ClassificationOutput)
        assert out.logits.shape == (2, NUM_ANSWERS if role == "qa" else 2)
        regions = out.region_attention
        assert regions.shape == inputs["visual_attention_mask"].shape
        assert (regions >= 0).all() and (regions[-1, ..., -1] == 0).all()  # none on the padded region


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_backbone_directory_loads_into_every_role(family, tmp_path):
    torch.manual_seed(0)
    models = FAMILIES[family].models
    cfg = _smallest_preset(family)
    backbone = models["backbone"](cfg)
    directory = backbone.save_pretrained(tmp_path / "backbone")
    for role, cls in models.items():
        kwargs = {"num_answers": NUM_ANSWERS} if role == "qa" else {}
        head = cls.from_pretrained(directory, **kwargs)
        state = head.state_dict()
        for key, value in backbone.state_dict().items():
            assert torch.equal(state[cls.base_model_prefix + key], value), (role, key)


def test_architecture_class_resolves_every_class_of_every_family():
    for name, family in FAMILIES.items():
        assert get_family(name) is family and family.name == name
        assert dataclasses.is_dataclass(family.config_class) and "backbone" in family.models
        for cls in family.models.values():
            assert architecture_class(cls.__name__) is cls
            assert family_of(cls.__name__) is family
            assert cls.config_class is family.config_class
    with pytest.raises(ValueError, match="unknown model family 'nope'; known: .*'lxmert'"):
        get_family("nope")
    with pytest.raises(ValueError, match="unknown architecture 'Nope'; known: .*'LxmertForNLVR2'"):
        architecture_class("Nope")
