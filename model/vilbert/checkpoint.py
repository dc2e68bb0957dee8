"""ViLBERT checkpoint directories (config.json + model.safetensors); any ViLBERT class loads any other's."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file, save_file

from .config import VilbertConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "xmodal-vilbert"

log = logging.getLogger(__name__)
M = TypeVar("M", bound="VilbertPretrained")


class VilbertPretrained:
    """`save_pretrained` / `from_pretrained`; the backbone lives at `backbone_prefix` (`""` in `Vilbert`,
    `"bert."` in the head classes), everything else is a head that loads only where names and shapes match."""

    backbone_prefix: str
    config: VilbertConfig

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
        """Load a directory written by any ViLBERT class; `overrides` are config fields or constructor
        arguments (`num_answers=3129`)."""
        directory = Path(directory)
        architecture, meta_cfg, init_kwargs, state = read_checkpoint(directory)
        fields = set(VilbertConfig.__dataclass_fields__)
        cfg = VilbertConfig.from_dict({**meta_cfg, **{k: v for k, v in overrides.items() if k in fields}})
        kwargs = init_kwargs if architecture == cls.__name__ else {}
        kwargs = {**kwargs, **{k: v for k, v in overrides.items() if k not in fields}}
        try:
            model = cls(cfg, **kwargs)  # type: ignore[call-arg]
        except TypeError as err:
            raise TypeError(
                f"cannot build {cls.__name__} from {directory} ({err}); pass the argument"
            ) from err
        load_weights(model, state, "" if architecture == "Vilbert" else "bert.", source=str(directory))
        return model


def read_checkpoint(directory: Path) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """(architecture, config dict, constructor kwargs, state dict) of a ViLBERT directory."""
    config_path, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not config_path.is_file() or not weights.is_file():
        raise FileNotFoundError(
            f"{directory}: expected {CONFIG_NAME} and {WEIGHTS_NAME} written by save_pretrained "
            "(convert released files with `xmodal convert vilbert`)"
        )
    meta = json.loads(config_path.read_text())
    if meta.get("format") != FORMAT or "architecture" not in meta or "config" not in meta:
        raise ValueError(f"{config_path} is not a ViLBERT checkpoint (format {meta.get('format')!r})")
    return meta["architecture"], meta["config"], meta.get("init_kwargs", {}), load_file(str(weights))


def load_weights(
    model: VilbertPretrained, state: dict[str, torch.Tensor], src_prefix: str, source: str
) -> None:
    """Copy `state` (backbone under `src_prefix`) into `model`: the backbone must be complete and of the
    config's shapes; heads of another name or shape stay freshly initialised (logged)."""
    dst_prefix = model.backbone_prefix
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
    backbone = [k for k in own if k.startswith(dst_prefix)]
    missing = [k for k in backbone if k not in mapped]
    if missing:
        raise ValueError(f"{source}: backbone weights missing: {missing}")
    bad = [k for k in backbone if own[k].shape != mapped[k].shape]
    if bad:
        detail = [f"{k}: file {tuple(mapped[k].shape)} vs model {tuple(own[k].shape)}" for k in bad]
        raise ValueError(f"{source}: backbone shapes differ from the config: {detail}")
    unknown = [k for k in mapped if k not in own]
    if unknown:
        raise ValueError(f"{source}: unexpected weights: {unknown}")
    mapped = {k: v for k, v in mapped.items() if own[k].shape == v.shape}
    model.load_state_dict(mapped, strict=False)  # type: ignore[attr-defined]
    fresh = sorted(k for k in own if k not in mapped)
    if fresh:
        log.warning("%s: %d head weights freshly initialised: %s", source, len(fresh), fresh)
    if ignored:
        log.info(
            "%s: %d weights of heads %s lacks are ignored: %s",
            source,
            len(ignored),
            type(model).__name__,
            ignored,
        )
