"""age encryption of external-weights exports (`save_weights_external(age_encryption_recipients=[...])`).

The SDK lets a caller name age X25519 recipients (`age1…` public keys); the export's files are then stored only as
`<name>.age`, encrypted to every recipient, so the files at the signed download URLs are useless to anyone else.
tinker-cookbook's `weights.download` of a training checkpoint relies on it: it exports to a fresh key, downloads,
requires every file to end in `.age`, decrypts, and deletes the export. We use pyrage (Rust `age` bindings), the
same library the cookbook decrypts with; the format is the age v1 standard (age-encryption.org/v1).
"""

from __future__ import annotations

from pathlib import Path

import pyrage

from tinkerflow.common.checkpoints import CheckpointError

AGE_SUFFIX = ".age"


def parse_recipients(recipients: list[str]) -> list[pyrage.x25519.Recipient]:
    """The X25519 recipients, or CheckpointError naming the one that is not an `age1…` public key."""
    parsed = []
    for i, text in enumerate(recipients):
        try:
            parsed.append(pyrage.x25519.Recipient.from_str(str(text).strip()))
        except Exception:
            raise CheckpointError(
                f"age_encryption_recipients[{i}] is not an age X25519 public key (age1…): {str(text)[:80]!r}"
            ) from None
    return parsed


def encrypt_tree(root: Path, recipients: list[str]) -> None:
    """Replace every file under `root` with `<file>.age`, encrypted to all `recipients`."""
    keys = parse_recipients(recipients)
    if not keys:
        return
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        path.with_name(path.name + AGE_SUFFIX).write_bytes(pyrage.encrypt(path.read_bytes(), keys))
        path.unlink()
