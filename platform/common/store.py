"""The claim-check store (docs/architecture.md §The claim-check data path): tensors and results live here, Temporal
history carries only a `BlobRef`.

fsspec makes the same code write a local directory (`file:///…`) or a bucket (`gs://bucket/prefix` through gcsfs).
Objects are content-addressed by kind and a fresh name; the ref records size and sha256 so a reader can tell a
truncated or swapped object from the one the workflow recorded.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import time
import uuid
from datetime import datetime

import fsspec

from tinkerflow.common.errors import InputError, StoreError
from tinkerflow.workflows.protocol.messages import BlobRef

log = logging.getLogger(__name__)


def is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def write_whole(fs, path: str, data: bytes) -> None:
    """Write `path` so a reader sees all of `data` or nothing: an object store replaces an object atomically; a
    local file system needs a rename."""
    if not is_local(fs):
        with fs.open(path, "wb") as f:
            f.write(data)
        return
    with fs.open(path + ".partial", "wb") as f:
        f.write(data)
    fs.mv(path + ".partial", path)


class ClaimCheckStore:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _uri(self, path: str) -> str:
        protocol = self.fs.protocol[0] if isinstance(self.fs.protocol, (tuple, list)) else self.fs.protocol
        return path if protocol == "file" else f"{protocol}://{path}"

    def put(self, data: bytes, kind: str) -> BlobRef:
        """Write `data` once under `<root>/<kind>/<uuid>` and return its reference."""
        path = f"{self.root}/{kind}/{uuid.uuid4().hex}"
        self.fs.makedirs(f"{self.root}/{kind}", exist_ok=True)
        write_whole(self.fs, path, data)
        return BlobRef(uri=self._uri(path), size=len(data), sha256=hashlib.sha256(data).hexdigest())

    def put_named(self, kind: str, name: str, data: bytes) -> None:
        """Write `data` as `<root>/<kind>/<name>`, replacing what was there: for objects found by a name both sides
        derive (an ephemeral snapshot's weights by its key), not by a ref carried in history."""
        self.fs.makedirs(f"{self.root}/{kind}", exist_ok=True)
        write_whole(self.fs, f"{self.root}/{kind}/{name}", data)

    def get_named(self, kind: str, name: str) -> bytes:
        path = f"{self.root}/{kind}/{name}"
        try:
            with self.fs.open(path, "rb") as f:
                return f.read()
        except FileNotFoundError as e:
            raise StoreError(f"claim-check object {self._uri(path)} is gone (collected or never written)") from e

    def delete_named(self, kind: str, prefix: str) -> int:
        """Delete the objects of `kind` whose names start with `prefix`; how many went (best effort, like `delete`)."""
        try:
            names = self.fs.glob(f"{self.root}/{kind}/{glob.escape(prefix)}*")
        except FileNotFoundError:
            return 0
        gone = 0
        for name in names:
            try:
                self.fs.rm(name)
                gone += 1
            except FileNotFoundError:
                pass
            except Exception:  # collection is best effort; the retention sweep takes what is left
                log.warning("could not delete claim-check object %s", name, exc_info=True)
        return gone

    def get(self, ref: BlobRef) -> bytes:
        try:
            with fsspec.open(ref.uri if "://" in ref.uri else "file://" + ref.uri, "rb") as f:
                data = f.read()  # pyright: ignore[reportAttributeAccessIssue] (one path opens one file, not a list)
        except FileNotFoundError as e:
            raise StoreError(f"claim-check object {ref.uri} is gone (collected or never written)") from e
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise StoreError(f"claim-check object {ref.uri} does not match its reference (size/hash)")
        return data

    def delete(self, ref: BlobRef) -> None:
        try:
            fs, path = fsspec.core.url_to_fs(ref.uri)
            fs.rm(path)
        except FileNotFoundError:
            pass
        except Exception:  # collection is best effort; an orphan costs disk, never correctness
            log.warning("could not delete claim-check object %s", ref.uri, exc_info=True)

    def cancel_marker(self, payload_uri: str) -> str:
        """Where cancel_future marks a queued sample, by its body's uri; the JAX worker looks before sampling."""
        return f"{self.root}/cancelled/{hashlib.sha256(payload_uri.encode()).hexdigest()}"

    def get_unless_cancelled(self, ref: BlobRef) -> bytes:
        """A sample's body, or InputError when cancel_future marked it before it ran."""
        if self.fs.exists(self.cancel_marker(ref.uri)):
            raise InputError("cancelled by the client (cancel_future) before it was sampled")
        return self.get(ref)

    def sweep(self, kind: str, older_than_s: float) -> tuple[int, int]:
        """Delete objects of `kind` written more than `older_than_s` ago, at any depth below it (the futures records
        of `retrieve_futures` sit in a folder per sampler and clone); returns (objects, bytes) removed. On a local
        disk the folders they leave empty go too, once as old (an object store has no folders to leave behind).

        Answers are read within seconds of being written and request bodies are needed at most until their run's
        next automatic snapshot, so a retention of hours loses nothing anyone will ask for.
        """
        cutoff = time.time() - older_than_s
        removed = freed = 0
        try:
            entries = self.fs.find(f"{self.root}/{kind}", detail=True, withdirs=True)
        except FileNotFoundError:
            return 0, 0
        folders = []
        for name, entry in entries.items():
            written = _written_at(entry)
            if entry.get("type") == "directory":
                folders.append((name, written))
            elif entry.get("type") == "file" and written is not None and written < cutoff:
                try:
                    self.fs.rm(name)
                    removed, freed = removed + 1, freed + int(entry.get("size") or 0)
                except FileNotFoundError:
                    pass
        if is_local(self.fs):
            top = f"{self.root}/{kind}"
            for name, written in sorted(folders, key=lambda f: -len(f[0])):  # the deepest first
                if name != top and written is not None and written < cutoff:
                    with contextlib.suppress(OSError):  # not empty (written since), or gone already
                        os.rmdir(name)
        return removed, freed


def _written_at(entry: dict) -> float | None:
    """Epoch seconds an object was written: `mtime` on local disk, `updated`/`timeCreated` (RFC3339) on GCS."""
    value = entry.get("mtime") or entry.get("updated") or entry.get("timeCreated")
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
