"""Model directories (config.json + model.safetensors): any class of a family loads one saved by any other."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from safetensors.torch import load_file, save_file

from .files import read_json, regular_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "xmodal"
# Directories written before families shared this module say "xmodal-<family>" ("xmodal-lxmert").
_FAMILY_FORMAT_PREFIX = "xmodal-"

# (architecture, config dict, constructor kwargs, state dict)
Checkpoint = tuple[str, dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]

log = logging.getLogger(__name__)
M = TypeVar("M", bound="PretrainedMixin")


@dataclass(frozen=True)
class Catalogue:
    """What loading needs to know about the families. `model.architectures` installs it on import, so this
    module names no family and imports none (the families import it)."""

    architecture_class: Callable[[str], type]  # class name recorded in config.json -> class
    family_name: Callable[[str], str]  # class name -> its family's name
    read_foreign: Callable[[Path], Checkpoint]  # a directory in another library's layout


_catalogue: Catalogue | None = None


def install_catalogue(catalogue: Catalogue) -> None:
    global _catalogue
    _catalogue = catalogue


def _families() -> Catalogue:
    if _catalogue is None:
        raise RuntimeError("no model families are known: import model (it installs model.architectures)")
    return _catalogue


class PretrainedMixin:
    """`save_pretrained` / `from_pretrained` for the model classes of every family.

    `config_class`: the family's config dataclass (with `from_dict` / `to_dict`). `base_model_prefix`: where
    the backbone's keys sit in this class's state dict, `""` in the backbone class itself and e.g.
    `"lxmert."` in its head classes. Keys outside the backbone are heads, which load only into a class that
    has heads of the same name and shape.
    """

    config_class: ClassVar[type]
    base_model_prefix: ClassVar[str]
    config: Any

    def init_kwargs(self) -> dict[str, Any]:
        """Constructor arguments besides the config, saved so the class can be rebuilt."""
        return {}

    def save_pretrained(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        architecture = type(self).__name__
        meta = {
            "format": FORMAT,
            "family": _families().family_name(architecture),
            "architecture": architecture,
            "init_kwargs": self.init_kwargs(),
            "config": self.config.to_dict(),
        }
        (directory / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}  # type: ignore[attr-defined]
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return directory

    @classmethod
    def from_pretrained(cls: type[M], directory: str | Path, **overrides: Any) -> M:
        """Load `directory` (saved by any class of this family, or in a foreign layout its family reads).

        `overrides` are config fields (e.g. `hidden_dropout_prob=0.2`) or constructor arguments
        (`num_answers=3129`); constructor arguments saved by the same class are reused.
        """
        architecture, meta_cfg, init_kwargs, state = read_checkpoint(directory)
        source = _source_class(architecture, Path(directory))
        if source.config_class is not cls.config_class:
            raise ValueError(
                f"{directory} holds a {architecture} ({source.config_class.__name__}); {cls.__name__} takes "
                f"a {cls.config_class.__name__}: load it with a class of its own family"
            )
        fields = {f.name for f in dataclasses.fields(cls.config_class)}
        cfg = cls.config_class.from_dict(
            {**meta_cfg, **{k: v for k, v in overrides.items() if k in fields}},
            where=f"{Path(directory) / CONFIG_NAME}",
        )
        kwargs = init_kwargs if architecture == cls.__name__ else {}
        kwargs = {**kwargs, **{k: v for k, v in overrides.items() if k not in fields}}
        try:
            # shapes first, with no storage: a config.json whose sizes disagree with its weights (65536
            # wide, 256 layers) is refused before the real build tries to allocate them
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                shapes = cls(cfg, **kwargs).state_dict()  # type: ignore[call-arg]
        except TypeError as err:
            raise TypeError(
                f"cannot build {cls.__name__} from {directory} ({err}); pass the missing argument"
            ) from err
        except Exception as err:  # noqa: BLE001 -- one that computes while built: the real build reports
            log.debug("%s: shapes not checked before building (%s)", directory, err)
        else:
            _match_state(shapes, state, source.base_model_prefix, cls.base_model_prefix, str(directory))
        model = cls(cfg, **kwargs)  # type: ignore[call-arg]
        load_weights(model, state, source.base_model_prefix, architecture, source=str(directory))
        return model


def _read_meta(directory: Path) -> dict[str, Any]:
    config_path = directory / CONFIG_NAME
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: expected a directory written by save_pretrained")
    meta = read_json(config_path, "model config")
    if not isinstance(meta, dict):
        raise ValueError(f"{config_path} holds no JSON object; rewrite it with save_pretrained")
    return meta


def _is_xmodal(meta: dict[str, Any]) -> bool:
    fmt = meta.get("format")
    return isinstance(fmt, str) and (fmt == FORMAT or fmt.startswith(_FAMILY_FORMAT_PREFIX))


def _xmodal_meta(directory: Path, meta: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    absent = [k for k in ("architecture", "config") if k not in meta]
    if absent:
        raise ValueError(
            f"{directory / CONFIG_NAME} lacks {absent}: rewrite the directory with save_pretrained"
        )
    return meta["architecture"], meta["config"], meta.get("init_kwargs", {})


def read_config(directory: str | Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(architecture, config dict, constructor kwargs); reads no weights when the directory is xmodal's."""
    directory = Path(directory)
    meta = _read_meta(directory)
    if not _is_xmodal(meta):
        return _families().read_foreign(directory)[:3]
    return _xmodal_meta(directory, meta)


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """(architecture, config dict, constructor kwargs, state dict) from an xmodal directory or a foreign one
    that some family reads (a HuggingFace LXMERT directory, say); the state has xmodal's names."""
    directory = Path(directory)
    meta = _read_meta(directory)
    if not _is_xmodal(meta):
        return _families().read_foreign(directory)
    architecture, config, init_kwargs = _xmodal_meta(directory, meta)
    weights = directory / WEIGHTS_NAME
    if not weights.exists():
        raise FileNotFoundError(f"{weights} not found beside {directory / CONFIG_NAME}")
    regular_file(weights, "weights")
    try:
        state = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise ValueError(
            f"{weights}: cannot be read as a safetensors file ({type(err).__name__}: {err})"
        ) from err
    return architecture, config, init_kwargs, state


def _source_class(architecture: str, directory: Path) -> type:
    try:
        return _families().architecture_class(architecture)
    except ValueError as err:
        raise ValueError(f"{directory / CONFIG_NAME}: {err}") from err


def load_weights(
    model: PretrainedMixin, state: dict[str, torch.Tensor], source_prefix: str, architecture: str, source: str
) -> None:
    """Copy `state` (saved by `architecture`, backbone keys under `source_prefix`) into `model`: the backbone
    must be complete, heads are optional."""
    own = model.state_dict()  # type: ignore[attr-defined]
    mapped, ignored = _match_state(own, state, source_prefix, model.base_model_prefix, source)
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


def _match_state(
    own: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    source_prefix: str,
    dst_prefix: str,
    source: str,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`state`'s tensors under the model's names (heads of another shape left out) and the keys ignored;
    a ValueError when the backbone is incomplete or of other shapes. `own` may be on the meta device."""
    mapped: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for key, value in state.items():
        if key.startswith(source_prefix):
            mapped[dst_prefix + key[len(source_prefix) :]] = value
        elif dst_prefix and key in own:
            mapped[key] = value
        else:
            ignored.append(key)
    backbone_missing = [k for k in own if k.startswith(dst_prefix) and k not in mapped]
    if backbone_missing:
        raise ValueError(f"{source}: backbone weights missing: {_few(backbone_missing)}")
    bad_shapes = [k for k, v in mapped.items() if k in own and own[k].shape != v.shape]
    backbone_bad = [k for k in bad_shapes if not dst_prefix or k.startswith(dst_prefix)]
    if backbone_bad:
        detail = [f"{k}: file {tuple(mapped[k].shape)} vs model {tuple(own[k].shape)}" for k in backbone_bad]
        raise ValueError(f"{source}: backbone shapes differ from the config: {_few(detail)}")
    unknown = [k for k in mapped if k not in own]
    if unknown:
        raise ValueError(f"{source}: unexpected weights: {_few(unknown)}")
    for key in bad_shapes:
        del mapped[key]
    return mapped, ignored


def _few(items: list[str]) -> str:
    """The first of a list that may run to thousands of keys (a config far from its weights)."""
    return f"{items[:8]}" + (f" and {len(items) - 8} more" if len(items) > 8 else "")
