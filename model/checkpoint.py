"""Checkpoint directories (config.json + model.safetensors); any class loads one saved by any other."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from .config import LxmertConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "xmodal-lxmert"

log = logging.getLogger(__name__)
M = TypeVar("M", bound="PretrainedMixin")


class PretrainedMixin:
    """`save_pretrained` / `from_pretrained` for the LXMERT classes.

    The backbone lives at `backbone_prefix` (`""` in `Lxmert`, `"lxmert."` in the head classes); keys outside
    it are heads, which load only into a class that has heads of the same name and shape.
    """

    backbone_prefix: str
    config: LxmertConfig

    def init_kwargs(self) -> dict[str, Any]:
        """Constructor arguments besides the config, saved so the class can be rebuilt."""
        return {}

    def save_pretrained(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT,
            "architecture": type(self).__name__,
            "init_kwargs": self.init_kwargs(),
            "config": self.config.to_dict(),
        }
        (directory / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}  # type: ignore[attr-defined]
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return directory

    @classmethod
    def from_pretrained(cls: type[M], directory: str | Path, **overrides: Any) -> M:
        """Load `directory` (saved by any xmodal LXMERT class, or a HuggingFace LXMERT directory).

        `overrides` are config fields (e.g. `hidden_dropout_prob=0.2`) or constructor arguments
        (`num_answers=3129`); constructor arguments saved by the same class are reused.
        """
        architecture, meta_cfg, init_kwargs, state = read_checkpoint(Path(directory))
        fields = set(LxmertConfig.__dataclass_fields__)
        cfg = LxmertConfig.from_dict({**meta_cfg, **{k: v for k, v in overrides.items() if k in fields}})
        kwargs = init_kwargs if architecture == cls.__name__ else {}
        kwargs = {**kwargs, **{k: v for k, v in overrides.items() if k not in fields}}
        try:
            model = cls(cfg, **kwargs)  # type: ignore[call-arg]
        except TypeError as err:
            raise TypeError(
                f"cannot build {cls.__name__} from {directory} ({err}); pass the missing argument"
            ) from err
        load_weights(model, state, architecture, source=str(directory))
        return model


def read_checkpoint(directory: Path) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(architecture, config dict, constructor kwargs, state dict) from an xmodal or HuggingFace directory."""
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: expected a directory written by save_pretrained")
    meta = json.loads(config_path.read_text())
    if meta.get("format") != FORMAT:
        from .convert import read_huggingface_dir

        return read_huggingface_dir(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found beside {config_path}")
    absent = [k for k in ("architecture", "config") if k not in meta]
    if absent:
        raise ValueError(f"{config_path} lacks {absent}: rewrite the directory with save_pretrained")
    return meta["architecture"], meta["config"], meta.get("init_kwargs", {}), load_file(str(weights))


def backbone_prefix_of(architecture: str) -> str:
    return "" if architecture == "Lxmert" else "lxmert."


def load_weights(
    model: PretrainedMixin, state: dict[str, torch.Tensor], architecture: str, source: str
) -> None:
    """Copy `state` (saved by `architecture`) into `model`: the backbone must be complete, heads optional."""
    src_prefix, dst_prefix = backbone_prefix_of(architecture), model.backbone_prefix
    own = model.state_dict()  # type: ignore[attr-defined]
    mapped: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for key, value in state.items():
        if key.startswith(src_prefix):
            mapped[dst_prefix + key[len(src_prefix) :]] = value
        elif dst_prefix and key in own:
            mapped[key] = value
        else:
            ignored.append(key)
    backbone_missing = [k for k in own if k.startswith(dst_prefix) and k not in mapped]
    if backbone_missing:
        raise ValueError(f"{source}: backbone weights missing: {backbone_missing}")
    bad_shapes = [k for k, v in mapped.items() if k in own and own[k].shape != v.shape]
    backbone_bad = [k for k in bad_shapes if not dst_prefix or k.startswith(dst_prefix)]
    if backbone_bad:
        detail = [f"{k}: file {tuple(mapped[k].shape)} vs model {tuple(own[k].shape)}" for k in backbone_bad]
        raise ValueError(f"{source}: backbone shapes differ from the config: {detail}")
    unknown = [k for k in mapped if k not in own]
    if unknown:
        raise ValueError(f"{source}: unexpected weights: {unknown}")
    for key in bad_shapes:
        del mapped[key]
    heads_fresh = sorted(k for k in own if k not in mapped)
    model.load_state_dict(mapped, strict=False)  # type: ignore[attr-defined]
    if heads_fresh:
        log.warning(
            "%s: %d head weights not in the file (or of another shape) are freshly initialised: %s",
            source,
            len(heads_fresh),
            heads_fresh,
        )
    if ignored:
        log.info(
            "%s: %d weights of heads %s has and %s lacks are ignored: %s",
            source,
            len(ignored),
            architecture,
            type(model).__name__,
            ignored,
        )
