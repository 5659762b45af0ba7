"""Which weights a JAX worker serves: the embedded tiny default, a local HF directory, or an HF id in the local cache.

Nothing is ever downloaded: a server must start the same offline. The served *name* is what clients send as
`base_model`. By default a local directory is served under its absolute path (something
`AutoTokenizer.from_pretrained` loads offline on the client) and a cached HF id under that id. `--served-model-name`
(vLLM's convention) serves a local copy of a Hugging Face model under the id it is a copy of, so clients that look
models up by name (tinker-cookbook's renderer and learning-rate tables) recognise it. `get_info` always reports the
local directory as `tokenizer_id`, so `TrainingClient.get_tokenizer()` loads the served model's own tokenizer offline
whatever the name; code that loads a tokenizer from the *name* (the SDK's `SamplingClient.get_tokenizer()`, the
cookbook's `get_tokenizer(model_name)`) finds it offline only where that id is in the local HF cache. We never give
the embedded tiny model a real model's id: its weights and tokenizer are not that model's, and a name-keyed table
(learning rate, renderer) or an HF-cache tokenizer would then describe another model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tinkerflow.common.errors import UnknownModelError
from tinkerflow.common.settings import Settings
from tinkerflow.workers.engine.model.families import EMBEDDED_DEFAULT, family_name_of

log = logging.getLogger(__name__)
TINY_MODEL_DIRNAME = f"tiny-{EMBEDDED_DEFAULT}"


def default_model_dir(settings: Settings) -> Path:
    return settings.models_dir / TINY_MODEL_DIRNAME


def resolve_base_model(settings: Settings) -> tuple[str, str]:
    """Return (served name, local directory) for `settings.base_model`, making the tiny default on first use."""
    name, local = _resolve(settings)
    served = settings.served_model_name.strip()
    if served and served != name:
        log.info("serving %s under the name %r", local, served)
        return served, local
    return name, local


def check_base_model(settings: Settings) -> None:
    """UnknownModelError, in one line, unless `settings.base_model` is a model directory (or cached HF id) of an
    architecture a model family serves; reads config.json only (no JAX), so `tinkerflow up` asks before it starts
    anything. The embedded default is served."""
    if settings.base_model:
        _resolve(settings)


def _check_served(path: Path) -> None:
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UnknownModelError(f"{path}/config.json cannot be read: {e}") from None
    try:
        family_name_of(hf if isinstance(hf, dict) else {})
    except ValueError as e:
        raise UnknownModelError(f"{path}: {e}") from None


def _resolve(settings: Settings) -> tuple[str, str]:
    spec = settings.base_model
    if not spec:
        from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

        path = make_tiny_model(default_model_dir(settings), progress=True).resolve()
        return _served_path_name(path), str(path)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path.resolve()
        if not (path / "config.json").exists():
            raise UnknownModelError(f"{path} has no config.json: not a Hugging Face model directory")
        _check_served(path)
        return _served_path_name(path), str(path)
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(spec, local_files_only=True)
    except Exception as e:
        raise UnknownModelError(
            f"base model {spec!r} is neither a local directory nor in the local Hugging Face cache ({e}). "
            f"Download it where you have network (`hf download {spec}`) and copy the cache here, or pass a path."
        ) from None
    _check_served(Path(local))
    return spec, local


def _served_path_name(path: Path) -> str:
    name = str(path)
    if name.count("/") == 2:
        # The SDK's SamplingClient.get_tokenizer turns "/a/b" into "/a" (docs/wire-contract.md §Tokenizer): warn, the
        # training client still works because get_info also reports the directory as tokenizer_id.
        log.warning("model path %s has exactly two '/'; SamplingClient.get_tokenizer() will not find it", name)
    return name
