"""What an API key means on this server, said the same way everywhere a person reads it: `tinkerflow up` prints it,
the console's sign-in page shows it and the API logs it at start."""

from __future__ import annotations


def tenant_mode(keys_configured: bool) -> str:
    """One sentence for a server started with or without accepted API keys (flags, env and the keys file). It names
    no count: the sign-in page shows it to anyone."""
    if not keys_configured:
        return (
            "no API keys configured: any key works (the SDK wants one that starts with tml-) and all keys are one "
            "tenant; start with --api-key to give each user their own"
        )
    return "API keys configured: only those are accepted, and each key is its own tenant that sees only its own runs"
