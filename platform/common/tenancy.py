"""What an API key means on this server: the tenant id it stands for (`key_id`), and one sentence said the same way
everywhere a person reads it (`tinkerflow up` prints it, the console's sign-in page shows it, the API logs it at
start)."""

from __future__ import annotations

import hashlib
import hmac


def key_id(signing_key: bytes, api_key: str) -> str:
    """A key's owner id: 16 hex digits keyed with the server key (docs/architecture.md §What tenancy promises), so an
    id seen in the Temporal UI, a search attribute, a checkpoint manifest or a /metrics label cannot be tested against
    guessed keys offline. Replicas share the key (--url-signing-key)."""
    message = b"tinkerflow-owner\0" + api_key.encode("utf-8", "replace")
    return hmac.new(signing_key, message, hashlib.sha256).hexdigest()[:16]


def tenant_mode(keys_configured: bool) -> str:
    """One sentence for a server started with or without accepted API keys (flags, env and the keys file). It names
    no count: the sign-in page shows it to anyone."""
    if not keys_configured:
        return (
            "no API keys configured: any key works (the SDK wants one that starts with tml-) and all keys are one "
            "tenant; start with --api-key to give each user their own"
        )
    return "API keys configured: only those are accepted, and each key is its own tenant that sees only its own runs"
