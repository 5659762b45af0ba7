"""docs/architecture.md §Layout and import names: the repo's platform/ folder must never shadow the standard
library's `platform`."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_stdlib_platform_still_imports_from_repo_root():
    out = subprocess.run(
        [sys.executable, "-c", "import platform; print(platform.system())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}


def test_store_roundtrip_and_integrity(tmp_path):
    from tinkerflow.common.store import ClaimCheckStore, StoreError
    from tinkerflow.workflows.protocol.messages import BlobRef

    store = ClaimCheckStore(tmp_path.as_uri())
    ref = store.put(b"hello tensors", "requests")
    assert store.get(ref) == b"hello tensors" and ref.size == 13
    forged = BlobRef(uri=ref.uri, size=ref.size, sha256="0" * 64)
    try:
        store.get(forged)
    except StoreError as e:
        assert "does not match" in str(e)
    else:
        raise AssertionError("a hash mismatch must be detected")
    store.delete(ref)
    try:
        store.get(ref)
    except StoreError as e:
        assert "gone" in str(e)
