"""Where ``init(model=...)`` gets the model's shape from: a spec, a preset, a dict, a file or
the user's own ``nn.Module``.

Pure (no torch import: a module is read by its attributes), so it stays under ``mypy --strict``.
``resihp launch --model X`` exports the spec it was given as ``$RESIHP_MODEL`` (JSON); a rank's
``init`` compares its own model with it (``check_launch_model``) so a launch that describes one
model while the script trains another fails at start-up, naming both.
"""
from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resihp.coordinator.model.spec import PRESETS, ModelSpec, SpecError, preset, same_shape

MODEL_ENV = "RESIHP_MODEL"  # the spec JSON `resihp launch --model` was given; unset = learn it from the ranks

# (field, attribute names that hold it), tried in order on ``module.config`` then on the module
_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("num_layers", ("num_hidden_layers", "n_layer", "num_layers", "n_layers")),
    ("hidden", ("hidden_size", "n_embd", "d_model", "dim", "hidden")),
    ("num_heads", ("num_attention_heads", "n_head", "num_heads", "n_heads")),
    ("vocab", ("vocab_size", "vocab", "n_vocab")),
)
_FFN = ("intermediate_size", "ffn_hidden", "n_inner", "ffn_dim", "d_ff")
_KV_HEADS = ("num_key_value_heads", "n_kv_head", "num_kv_heads", "n_kv_heads")


def spec_json(spec: ModelSpec) -> str:
    """The spec as one line of JSON (what ``$RESIHP_MODEL`` and the hook hello carry)."""
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


def resolve_model(model: object) -> ModelSpec:
    """A ModelSpec from any of the forms ``init`` accepts: a ModelSpec, a preset name, a dict of
    ModelSpec fields (or ``{"preset": NAME}``), a path to a JSON/YAML file holding one, or an
    ``nn.Module`` whose ``config`` (nanoGPT's GPTConfig, a Hugging Face config) names its shape."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Mapping):
        return ModelSpec.from_dict(dict(model))  # pyright: ignore[reportUnknownArgumentType]  # a user's mapping
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)  # pyright: ignore[reportUnknownArgumentType, reportUnknownVariableType]  # str | PathLike[str]
        if isinstance(model, str) and text in PRESETS:
            return PRESETS[text]
        if Path(str(text)).suffix.lower() in (".json", ".yaml", ".yml") or Path(str(text)).is_file():
            return _from_file(Path(str(text)))
        return preset(str(text))  # names the known presets
    if hasattr(model, "parameters") and callable(getattr(model, "parameters", None)):
        return spec_from_module(model)
    raise SpecError(f"init: model must be a ModelSpec, a preset name, a dict, a JSON/YAML file or an nn.Module; "
                    f"got {type(model).__name__}")


def _from_file(path: Path) -> ModelSpec:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"model file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            yaml = importlib.import_module("yaml")  # only needed for YAML files
            data: Any = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError are both ValueErrors or close
        raise SpecError(f"model file {str(path)!r} is not valid {path.suffix.lstrip('.').upper()}: {exc}") from None
    except Exception as exc:  # yaml.YAMLError is no ValueError
        raise SpecError(f"model file {str(path)!r} is not valid YAML: {exc}") from None
    if isinstance(data, Mapping) and "model" in data and len(data) == 1:  # pyright: ignore[reportUnknownArgumentType]
        data = data["model"]
    try:
        return ModelSpec.from_dict(data)
    except SpecError as exc:
        raise SpecError(f"model file {str(path)!r}: {exc}") from None


def _lookup(sources: tuple[object, ...], names: tuple[str, ...]) -> tuple[int | None, str]:
    for src in sources:
        for name in names:
            value = getattr(src, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, name
    return None, ""


_GATED = ("gate_proj", "gate_up_proj", "w3", "gate")  # a gated MLP's sub-module names


def spec_from_module(module: object, name: str = "") -> ModelSpec:
    """Read a transformer's shape from common attribute names on ``module.config`` (or the module).

    nanoGPT: ``n_layer``, ``n_embd``, ``n_head``, ``vocab_size`` (FFN 4×n_embd); Hugging Face:
    ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``intermediate_size``,
    ``vocab_size`` (and ``num_key_value_heads``); a ``gate_proj`` (or fused ``gate_up_proj``, as
    Phi-3 and GLM have) sub-module means a gated MLP."""
    config = getattr(module, "config", None)
    sources = (config, module) if config is not None else (module,)
    found: dict[str, Any] = {}
    missing: list[str] = []
    for field, names in _FIELDS:
        value, _ = _lookup(sources, names)
        if value is None:
            missing.append(f"{field} (one of {', '.join(names)})")
        else:
            found[field] = value
    where = f"{type(module).__name__}" + (f".config ({type(config).__name__})" if config is not None else "")
    if missing:
        raise SpecError(f"init: cannot read the model's shape from {where}: missing {'; '.join(missing)}. "
                        f"Pass model= a ModelSpec, a preset name or a dict of ModelSpec fields instead")
    ffn, _ = _lookup(sources, _FFN)
    found["ffn_hidden"] = ffn if ffn is not None else 4 * int(found["hidden"])  # GPT-2 / nanoGPT: 4× the width
    kv, _ = _lookup(sources, _KV_HEADS)
    if kv is not None and kv != found["num_heads"]:
        found["num_kv_heads"] = kv
    named = getattr(module, "named_modules", None)
    if callable(named):
        try:
            modules: Any = named()
            found["gated_mlp"] = any(str(n).rsplit(".", 1)[-1] in _GATED for n, _ in modules)
        except (TypeError, ValueError):
            pass
    label = name or str(getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or "")
    found["name"] = label or type(module).__name__
    return ModelSpec(**found)


def check_launch_model(spec: ModelSpec, environ: Mapping[str, str] | None = None) -> ModelSpec | None:
    """Compare the script's model with the one ``resihp launch --model`` was given ($RESIHP_MODEL);
    raises SpecError naming both when they differ. Returns the launch's spec (None: not given)."""
    text = (os.environ if environ is None else environ).get(MODEL_ENV, "").strip()
    if not text:
        return None
    try:
        launched = ModelSpec.from_dict(json.loads(text))
    except (ValueError, SpecError) as exc:
        raise SpecError(f"${MODEL_ENV} holds no model spec ({exc}); it is set by `resihp launch --model`") from None
    if not same_shape(launched, spec):
        raise SpecError(f"init: `resihp launch --model` describes {_describe(launched)} but the script trains "
                        f"{_describe(spec)}; give launch the script's model (or leave --model out: the launch "
                        f"then learns it from the ranks)")
    return launched


def _describe(spec: ModelSpec) -> str:
    kv = f" kv_heads={spec.kv_heads}" if spec.kv_heads != spec.num_heads else ""
    return (f"{spec.name!r} (layers={spec.num_layers} hidden={spec.hidden} heads={spec.num_heads}{kv} "
            f"ffn={spec.ffn_hidden} vocab={spec.vocab}{' gated' if spec.gated_mlp else ''})")
