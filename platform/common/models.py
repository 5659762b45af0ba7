"""Which weights a JAX worker serves: the embedded tiny default, a local HF directory, or an HF id in the local cache.

Nothing is ever downloaded (house rule 2). The served *name* is what clients send as `base_model`; it must also be
something `AutoTokenizer.from_pretrained` can load offline on the client, so a local directory is served under its
absolute path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tinkerflow.common.settings import Settings

log = logging.getLogger(__name__)
TINY_MODEL_DIRNAME = "tiny-qwen3"


class UnknownModelError(ValueError):
    pass


def default_model_dir(settings: Settings) -> Path:
    return settings.models_dir / TINY_MODEL_DIRNAME


def resolve_base_model(settings: Settings) -> tuple[str, str]:
    """Return (served name, local directory) for `settings.base_model`, making the tiny default on first use."""
    spec = settings.base_model
    if not spec:
        from tinkerflow.workers.engine.tiny_model import make_tiny_model

        path = make_tiny_model(default_model_dir(settings), progress=True).resolve()
        return _served_path_name(path), str(path)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path.resolve()
        if not (path / "config.json").exists():
            raise UnknownModelError(f"{path} has no config.json: not a Hugging Face model directory")
        return _served_path_name(path), str(path)
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(spec, local_files_only=True)
    except Exception as e:
        raise UnknownModelError(
            f"base model {spec!r} is neither a local directory nor in the local Hugging Face cache ({e}). "
            f"Download it where you have network (`hf download {spec}`) and copy the cache here, or pass a path."
        ) from None
    return spec, local


def _served_path_name(path: Path) -> str:
    name = str(path)
    if name.count("/") == 2:
        # The SDK's SamplingClient.get_tokenizer turns "/a/b" into "/a" (contract §10): warn, the training
        # client still works because get_info also reports the directory as tokenizer_id.
        log.warning("model path %s has exactly two '/'; SamplingClient.get_tokenizer() will not find it", name)
    return name
