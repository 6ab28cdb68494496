"""What can be known about a policy before it is built, checked: a preset's `overrides` against its
`transformers` config class, a local checkpoint folder (config.json, weights, each safetensors file
whole), the model's position limit, type and vocabulary, and the device it is asked to run on.

    facts = preset_facts("tiny-qwen3_5", {"num_hidden_layers": 2})   # ValueError for a key the class lacks
    facts = checkpoint_facts("runs/x/checkpoint")                   # ValueError naming a missing or cut file
    facts.max_positions, facts.model_type, facts.vocab_size
    check_device("cuda:1", "model.device")                          # ValueError on a machine without it

Errors start with the key they are about (`overrides.num_hidden_layerz: ...`, `path: ...`), the
caller puts the source and the section in front. Nothing here imports torch or transformers at
import time: `transformers` only for a preset with overrides (or one whose config leaves a limit
to the class default), torch only in `check_device`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

from longstraw.models.presets import MODEL_CLASSES, PRESETS, check_preset

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# what peft's `save_pretrained` writes a trained LoRA adapter to: its settings and its weights
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class ModelFacts:
    """What a point's checks need of a model: where its facts come from (for messages) and the facts."""

    what: str  # "preset tiny-llama", "runs/x/checkpoint/config.json"
    model_type: str | None
    max_positions: int | None
    vocab_size: int | None


# ---------------------------------------------------------------------------------------------- presets


def _config_class(model_type: str):
    transformers = importlib.import_module("transformers")
    return getattr(transformers, MODEL_CLASSES[model_type][0])


_KWARG_NAME = re.compile(r"""kwargs\.(?:pop|get|setdefault)\(\s*["'](\w+)["']""")
_READ_BY_MODEL = re.compile(r"""getattr\(\s*(?:self\.)?config\s*,\s*["'](\w+)["']|\bconfig\.(\w+)""")


@functools.cache
def config_keys(model_type: str) -> frozenset[str]:
    """Every key the config class of `model_type` takes as a field of the model: its `__init__`
    parameters (transformers 5 configs are dataclasses: their fields), its `attribute_map`, the
    public attributes of a default instance, the keyword arguments its `__post_init__`s and the RoPE
    conversion take from `**kwargs` (`rope_theta`, `partial_rotary_factor`, ...), and the names its
    modeling module reads off the config (`getattr(config, "head_dim", ...)`). Whatever else a config
    class accepts it keeps as an attribute nothing reads."""
    cls = _config_class(model_type)
    keys = {
        name
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"
    }
    if dataclasses.is_dataclass(cls):
        keys |= {f.name for f in dataclasses.fields(cls)}
    keys |= set(getattr(cls, "attribute_map", None) or {})
    try:
        keys |= {k for k in vars(cls()) if not k.startswith("_")}
    except Exception:  # a class without a default instance: its fields and parameters still say
        pass
    sources = [klass.__post_init__ for klass in cls.__mro__ if "__post_init__" in vars(klass)]
    if hasattr(cls, "convert_rope_params_to_dict"):
        sources.append(cls.convert_rope_params_to_dict)
    for function in sources:
        try:
            keys |= set(_KWARG_NAME.findall(inspect.getsource(function)))
        except (OSError, TypeError):
            pass
    spec = importlib.util.find_spec(cls.__module__.replace(".configuration_", ".modeling_"))
    if spec is not None and spec.origin and spec.origin.endswith(".py"):
        text = Path(spec.origin).read_text()
        keys |= {a or b for a, b in _READ_BY_MODEL.findall(text)}
    return frozenset(k for k in keys if not k.startswith("_"))


def check_override_keys(model_type: str, overrides: dict, key: str = "overrides") -> None:
    """Refuse an override the config class of `model_type` does not know (`config_keys`), naming the
    closest key it does."""
    known = config_keys(model_type)
    for name in overrides:
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{key}.{name}: not a field of {MODEL_CLASSES[model_type][0]}{hint}")


def preset_facts(name: str, overrides: dict | None = None, key: str = "overrides") -> ModelFacts:
    """A preset's facts with `overrides` applied. With overrides, their keys are checked against the
    config class and the config is made (its own type and value checks run); without, the preset's
    settings are read and `transformers` is imported only if they leave the limit to the class default."""
    check_preset(name)
    preset = PRESETS[name]
    settings = {**preset.config, **(overrides or {})}
    if overrides:
        check_override_keys(preset.model_type, overrides, key)
        from longstraw.models.presets import make_config

        try:
            config = make_config(name, **overrides)
        except Exception as exc:  # the config class's own checks (types, relations between fields)
            shown = " ".join(str(exc).split())  # one line
            raise ValueError(
                f"{key}: {MODEL_CLASSES[preset.model_type][0]} refuses them: {type(exc).__name__}: {shown}"
            ) from None
        settings = {
            "max_position_embeddings": getattr(config, "max_position_embeddings", None),
            "vocab_size": getattr(config, "vocab_size", None),
        }
    elif "max_position_embeddings" not in settings or "vocab_size" not in settings:
        default = _config_class(preset.model_type)()
        settings = {
            "max_position_embeddings": getattr(default, "max_position_embeddings", None),
            "vocab_size": getattr(default, "vocab_size", None),
            **settings,
        }
    return ModelFacts(
        f"preset {name}",
        preset.model_type,
        _int_or_none(settings.get("max_position_embeddings")),
        _int_or_none(settings.get("vocab_size")),
    )


def _int_or_none(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ----------------------------------------------------------------------------------------- checkpoints


def checkpoint_facts(
    path, key: str = "path", overrides: dict | None = None, overrides_key: str = "overrides"
) -> ModelFacts:
    """A local checkpoint folder checked before anything loads it: the folder, its config.json, its
    weights (`model.safetensors`, a safetensors index and every shard it names, or `pytorch_model.bin`)
    and every safetensors file whole (header and data as long as the header says). Its facts from config.json,
    with `overrides` (config fields the loader sets over it, checked against its config class) applied."""
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"{key}: no checkpoint folder {path}")
    if not folder.is_dir():
        raise ValueError(
            f"{key}: {path} is a file, not a checkpoint folder (config.json and weights, as "
            "save_pretrained writes them)"
        )
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"{key}: {path} holds no {CONFIG_FILE} (a checkpoint folder as save_pretrained writes it)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{key}: {config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{key}: {config_file}: expected a JSON object, got {type(config).__name__}")
    _check_weights(folder, key)
    if overrides:
        if config.get("model_type") not in MODEL_CLASSES:
            raise ValueError(
                f"{overrides_key}: cannot be checked against {config_file}'s model_type "
                f"{config.get('model_type')!r} (known: {sorted(MODEL_CLASSES)})"
            )
        check_override_keys(config["model_type"], overrides, overrides_key)
        config = {**config, **overrides}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return ModelFacts(
        str(config_file),
        config.get("model_type"),
        _int_or_none(config.get("max_position_embeddings", text.get("max_position_embeddings"))),
        _int_or_none(config.get("vocab_size", text.get("vocab_size"))),
    )


def _check_weights(folder: Path, key: str) -> None:
    index = folder / SAFETENSORS_INDEX
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
            raise ValueError(f"{key}: {index}: not a safetensors index ({exc})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{key}: {index}: no weight_map naming the shards")
        for shard in sorted(set(weight_map.values())):
            if not (folder / str(shard)).is_file():
                raise ValueError(f"{key}: {index} names the shard {shard}, which is missing from {folder}")
        files = sorted(set(files) | {folder / str(s) for s in weight_map.values()})
    elif not files and not any((folder / name).is_file() for name in BIN_WEIGHTS):
        raise ValueError(
            f"{key}: {folder} holds no weights (model.safetensors, {SAFETENSORS_INDEX} and its "
            "shards, or pytorch_model.bin)"
        )
    for file in files:
        check_safetensors(file, key)


def check_adapter_folder(path, key: str) -> None:
    """A trained adapter's folder as peft saves it: its settings and whole weights, else a ValueError naming `key`."""
    folder = Path(path)
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{key}: no trained peft adapter at {path} ({' and '.join(missing)} missing)")
    check_safetensors(folder / ADAPTER_WEIGHTS, key)


def check_safetensors(file: Path, key: str = "path") -> None:
    """Refuse a safetensors file that is cut short or whose header does not read: 8 bytes of header
    length (little-endian), the JSON header, then at least as many bytes as its tensors' largest end offset."""
    size = file.stat().st_size
    if size < 8:
        raise ValueError(
            f"{key}: {file}: truncated ({size} bytes; a safetensors file starts with an 8-byte header length)"
        )
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if 8 + length > size:
            raise ValueError(
                f"{key}: {file}: truncated or not safetensors: its header length says {length:,} "
                f"bytes, the file holds {size:,}"
            )
        try:
            header = json.loads(f.read(length))
            ends = [int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"]
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            AttributeError,
            KeyError,
            IndexError,
            TypeError,
            ValueError,
        ) as exc:
            raise ValueError(f"{key}: {file}: corrupt safetensors header ({type(exc).__name__}: {exc})") from None
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        raise ValueError(
            f"{key}: {file}: truncated: {size:,} bytes, but its header places tensor data up to byte "
            f"{needed:,} (a copy or a save cut short?)"
        )


# ---------------------------------------------------------------------------------------------- device


def check_device(spec: str, key: str = "device") -> None:
    """Refuse a device this machine does not have: `cuda` on a torch without CUDA (or none visible), or
    `cuda:N` beyond the device count."""
    import torch

    device = torch.device(spec)
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(
            f"{key}: {spec!r}, but this torch ({torch.__version__}, {build}) sees no CUDA device; "
            "use device: cpu here, or run where a GPU is"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{key}: {spec!r}, but this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
