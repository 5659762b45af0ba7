"""Time-limited, signed download URLs for checkpoint files (`external_weights_urls`, docs/wire-contract.md §RestClient
routes).

The SDK's `tinker checkpoint download` fetches each URL with plain urllib, without the API key, so the URL itself
carries the authority: an HMAC over the checkpoint path, the file and the expiry. Any API replica holding the same
key verifies it; nothing is stored per URL.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from urllib.parse import quote

from tinkerflow.common.settings import Settings

log = logging.getLogger(__name__)
URL_LIFETIME_S = 3600


def signing_key(settings: Settings) -> bytes:
    if settings.url_signing_key:
        return settings.url_signing_key.encode()
    path = settings.state_dir / "url-signing.key"
    if not path.exists():
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # a racing replica keeps the first key
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        log.info("made a URL signing key in %s (set --url-signing-key to share one across API replicas)", path)
    return path.read_text().strip().encode()


def _signature(key: bytes, tinker_path: str, relative: str, expires: int) -> str:
    message = f"{tinker_path}\n{relative}\n{expires}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, base_url: str, tinker_path: str, relative: str, expires: int) -> str:
    route = tinker_path.removeprefix("tinker://")
    return (
        f"{base_url.rstrip('/')}/api/v1/checkpoint_files/{quote(route)}/{quote(relative)}"
        f"?expires={expires}&signature={_signature(key, tinker_path, relative, expires)}"
    )


def verify(key: bytes, tinker_path: str, relative: str, expires: int, signature: str) -> bool:
    if expires < time.time():
        return False
    return hmac.compare_digest(_signature(key, tinker_path, relative, expires), signature)


def expiry() -> int:
    return int(time.time()) + URL_LIFETIME_S
