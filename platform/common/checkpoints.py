"""Checkpoint storage: where `tinker://<run>/<kind>/<name>` lives, and the manifest that makes it exist.

Layout under the checkpoint root (fsspec: `file:///…` locally, `gs://bucket/prefix` on GKE):

    <root>/<training_run_id>/<segment>/<name>/checkpoint.json     the manifest, written LAST
    <root>/<training_run_id>/<segment>/<name>/...                 the payload (orbax state or PEFT files)

A checkpoint exists exactly when its manifest does. A writer uploads the payload first and the manifest last, and a
deleter removes the manifest first, so a save cut short (the JAX worker killed mid-write) leaves files that never
list and never load; the next save of that name sweeps them. The manifest also carries what the REST surface shows
(owner, base model, LoRA config, size, publicity, expiry) so listing never opens a payload.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fsspec

from tinkerflow.common.errors import CheckpointError, CheckpointNotFound
from tinkerflow.common.store import write_whole

log = logging.getLogger(__name__)

MANIFEST = "checkpoint.json"
SEGMENTS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
# The service's own automatic snapshots (worker-death recovery): training state like `weights`, never listed,
# never loadable by a client.
AUTO_SEGMENT = "auto_weights"
TRAINING_STATE_SEGMENTS = ("weights", AUTO_SEGMENT)
MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 24 * 3600
# Each becomes one directory name in the store; file systems allow 255 bytes.
MAX_PATH_PART = 200
_NAME = re.compile(r"^[A-Za-z0-9._\-]+$")
_RUN = re.compile(r"^[A-Za-z0-9._\-]+(:[A-Za-z0-9._\-]+)*$")
# Each is one directory name under the checkpoint root (file systems stop at 255 bytes) and part of workflow ids.
MAX_NAME_CHARS = 128
MAX_RUN_CHARS = 128


@dataclass(frozen=True)
class TinkerPath:
    run: str  # training_run_id == model_id
    segment: str  # weights | sampler_weights | external_weights
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        return SEGMENTS.get(self.segment, "training")

    def __str__(self) -> str:
        return f"tinker://{self.run}/{self.segment}/{self.name}"

    @staticmethod
    def parse(path: str) -> TinkerPath:
        """`tinker://<run>/<segment>/<name>`, as the SDK's ParsedCheckpointTinkerPath reads it (docs/wire-contract.md
        §Ids and paths)."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise CheckpointError(
                f"{_shown(path)} is not a tinker:// path; expected tinker://<run>/<kind>/<name> "
                "as save_state / save_weights_for_sampler returned it"
            )
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3:
            raise CheckpointError(
                f"{_shown(path)} is malformed; expected tinker://<run>/<kind>/<name> "
                "(exactly three parts, the name has no '/')"
            )
        run, segment, name = parts
        if segment not in SEGMENTS and segment != AUTO_SEGMENT:
            raise CheckpointError(
                f"{_shown(path)}: unknown checkpoint kind {_shown(segment)}; one of {', '.join(SEGMENTS)}"
            )
        return TinkerPath.of(run, segment, name)

    @staticmethod
    def of(run: str, segment: str, name: str) -> TinkerPath:
        if len(run) > MAX_PATH_PART or len(name) > MAX_PATH_PART:  # else "File name too long" from the store: a 500
            raise CheckpointError(f"training run id and checkpoint name are at most {MAX_PATH_PART} characters each")
        check_name(name)
        check_run(run)
        if segment not in SEGMENTS and segment != AUTO_SEGMENT:
            raise CheckpointError(f"unknown checkpoint kind {_shown(segment)}; one of {', '.join(SEGMENTS)}")
        return TinkerPath(run, segment, name)

    @staticmethod
    def from_checkpoint_id(run: str, checkpoint_id: str) -> TinkerPath:
        segment, _, name = checkpoint_id.partition("/")
        return TinkerPath.of(run, segment, name)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_name(name: str | None) -> None:  # None (or any non-str) is refused like a bad name
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_NAME_CHARS
        or not _NAME.fullmatch(name)
        or name in (".", "..")
    ):
        raise CheckpointError(
            f"checkpoint name {_shown(name)} must be non-empty, at most {MAX_NAME_CHARS} "
            "characters, and use only letters, digits, '.', '_' and '-' (no '/')"
        )


def check_run(run: str) -> None:
    """A training run id (the model_id): one directory name; `*`, `/`, `..` and the like never reach a path or glob."""
    if (
        not isinstance(run, str)
        or not run
        or len(run) > MAX_RUN_CHARS
        or not _RUN.fullmatch(run)
        or run.startswith(".")
    ):
        raise CheckpointError(
            f"training run id {_shown(run)} is malformed: 1 to {MAX_RUN_CHARS} letters, digits, "
            "'.', '_', '-' and ':' as the server returned it (e.g. sess-0a1b2c3d4e5f:train:0)"
        )


def check_ttl(ttl_seconds: Any) -> None:
    """None (no expiry) or a whole number of seconds in range; anything else (a string, NaN, 1e300, a bool) is a
    CheckpointError naming the field, never a crash further on."""
    if ttl_seconds is None:
        return
    whole = isinstance(ttl_seconds, int) or (isinstance(ttl_seconds, float) and ttl_seconds.is_integer())
    if isinstance(ttl_seconds, bool) or not whole:
        raise CheckpointError(f"ttl_seconds must be a whole number of seconds or null, got {ttl_seconds!r}")
    if not (MIN_TTL_S <= ttl_seconds <= MAX_TTL_S):
        raise CheckpointError(
            f"ttl_seconds {ttl_seconds} is outside {MIN_TTL_S} (1 hour) .. {MAX_TTL_S} (10 years); "
            "pass None for no expiry"
        )


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def parse_time(s: str | None) -> datetime | None:
    return datetime.fromisoformat(s.replace("Z", "+00:00")) if s else None


def expiry_after(ttl_seconds: int | None, now: datetime | None = None) -> str | None:
    if ttl_seconds is None:
        return None
    return rfc3339((now or datetime.now(UTC)) + timedelta(seconds=int(ttl_seconds)))


@dataclass(frozen=True)
class Manifest:
    tinker_path: str
    owner: str  # the API key hash of the run's owner ("" when the API is open)
    base_model: str
    lora: dict[str, Any]  # rank, seed, train_attn, train_mlp, train_unembed
    time: str  # RFC3339, when it was committed
    step: int = 0
    has_optimizer: bool = False
    size_bytes: int = 0
    files: dict[str, int] = field(default_factory=dict)  # relative path -> bytes
    public: bool = False
    expires_at: str | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    format: str = ""  # "orbax+peft-config" (training) | "peft" (sampler, external)

    @property
    def path(self) -> TinkerPath:
        return TinkerPath.parse(self.tinker_path)

    def expired(self, now: datetime | None = None) -> bool:
        expires = parse_time(self.expires_at)
        return expires is not None and expires <= (now or datetime.now(UTC))

    def readable_by(self, owner: str) -> bool:
        return self.public or self.owner == owner

    def as_checkpoint(self) -> dict[str, Any]:
        """The SDK's `Checkpoint` (types/checkpoint.py)."""
        p = self.path
        out: dict[str, Any] = {
            "checkpoint_id": p.checkpoint_id,
            "checkpoint_type": p.checkpoint_type,
            "time": self.time,
            "tinker_path": self.tinker_path,
            "size_bytes": self.size_bytes,
            "public": self.public,
            "expires_at": self.expires_at,
        }
        if self.user_metadata:
            out["user_metadata"] = self.user_metadata
        return out

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> Manifest:
        raw = json.loads(data)
        known = {f for f in Manifest.__dataclass_fields__}
        return Manifest(**{k: v for k, v in raw.items() if k in known})


class CheckpointStore:
    """Checkpoints under one fsspec root. Blocking calls: async callers wrap them in `asyncio.to_thread`."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.fs.makedirs(self.root, exist_ok=True)

    def dir_of(self, p: TinkerPath) -> str:
        return f"{self.root}/{p.run}/{p.segment}/{p.name}"

    # --- reading ---------------------------------------------------------------------------------------------------

    def manifest(self, p: TinkerPath, *, include_expired: bool = False) -> Manifest | None:
        try:
            with self.fs.open(f"{self.dir_of(p)}/{MANIFEST}", "rb") as f:
                m = Manifest.from_json(f.read())
        except FileNotFoundError:
            return None
        if m.expired() and not include_expired:
            return None
        return m

    def readable(self, path: str, owner: str) -> Manifest:
        """The manifest of `path` if `owner` may read it; otherwise a CheckpointError that says why.

        Another tenant's private checkpoint gets the same answer as a missing one: nobody learns it exists.
        """
        p = TinkerPath.parse(path)
        m = self.manifest(p, include_expired=True) if p.segment in SEGMENTS else None
        if m is None or not m.readable_by(owner):
            raise CheckpointNotFound(f"checkpoint {path} does not exist (never saved, deleted, or not yours)")
        if m.expired():
            raise CheckpointNotFound(f"checkpoint {path} expired at {m.expires_at}")
        return m

    def list(self, run: str | None = None) -> list[Manifest]:
        """Committed, unexpired checkpoints of one run (or of every run), newest first."""
        if run is not None:
            check_run(run)  # never a glob pattern from a caller
        pattern = f"{self.root}/{run or '*'}/*/*/{MANIFEST}"
        out = []
        for path in self.fs.glob(pattern):
            try:
                with self.fs.open(path, "rb") as f:
                    m = Manifest.from_json(f.read())
            except (FileNotFoundError, ValueError, TypeError) as e:  # deleted meanwhile, or not ours
                log.debug("skipping %s: %s", path, e)
                continue
            if not m.expired() and m.path.segment in SEGMENTS:
                out.append(m)
        return sorted(out, key=lambda m: (m.time, m.tinker_path), reverse=True)

    def files(self, p: TinkerPath) -> dict[str, int]:
        """Payload files of a committed checkpoint, relative path -> size (the manifest's record)."""
        m = self.manifest(p)
        if m is None:
            raise CheckpointNotFound(f"checkpoint {p} does not exist")
        return dict(m.files)

    def open_file(self, p: TinkerPath, relative: str):
        if relative not in self.files(p):
            raise CheckpointNotFound(f"{relative} is not a file of {p}")
        return self.fs.open(f"{self.dir_of(p)}/{relative}", "rb")

    def download(self, p: TinkerPath, local_dir: Path) -> Manifest:
        """Copy a committed checkpoint's payload into `local_dir` (for orbax and safetensors readers)."""
        m = self.manifest(p)
        if m is None:
            raise CheckpointNotFound(f"checkpoint {p} does not exist (never saved, deleted or expired)")
        for relative in m.files:
            target = local_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get(f"{self.dir_of(p)}/{relative}", str(target))
        return m

    # --- writing ---------------------------------------------------------------------------------------------------

    def commit(
        self, manifest: Manifest, local_dir: Path, *, overwrite: bool, pause_before_manifest_s: float = 0.0
    ) -> Manifest:
        """Upload `local_dir` as the payload of `manifest.tinker_path`, then write the manifest.

        `pause_before_manifest_s` exists for fault-injection tests (TINKERFLOW_FAULT_PAUSE_BEFORE_COMMIT_S): it
        widens the window in which a killed writer leaves an uncommitted checkpoint behind.
        """
        p = manifest.path
        target = self.dir_of(p)
        existing = self.manifest(p, include_expired=True)
        if existing is not None and not existing.expired() and not overwrite:
            raise CheckpointError(f"checkpoint {p} already exists; pass overwrite=True to replace it")
        self._remove(target)  # the old checkpoint, an expired one, or the leftovers of an interrupted save
        files = {str(f.relative_to(local_dir)): f.stat().st_size for f in sorted(local_dir.rglob("*")) if f.is_file()}
        for relative in files:
            self.fs.makedirs(os.path.dirname(f"{target}/{relative}"), exist_ok=True)
            self.fs.put_file(str(local_dir / relative), f"{target}/{relative}")
        if pause_before_manifest_s > 0:
            import time

            log.warning("fault injection: pausing %.1fs before committing %s", pause_before_manifest_s, p)
            time.sleep(pause_before_manifest_s)
        manifest = replace(manifest, files=files, size_bytes=sum(files.values()))
        self._write_manifest(p, manifest)
        return manifest

    def update(self, p: TinkerPath, **changes: Any) -> Manifest:
        """Change manifest fields of a committed checkpoint (publicity, expiry)."""
        m = self.manifest(p)
        if m is None:
            raise CheckpointNotFound(f"checkpoint {p} does not exist")
        m = replace(m, **changes)
        self._write_manifest(p, m)
        return m

    def delete(self, p: TinkerPath) -> bool:
        """Remove a checkpoint: the manifest first (it stops existing at once), then its files."""
        target = self.dir_of(p)
        existed = self.fs.exists(f"{target}/{MANIFEST}")
        if existed:
            self.fs.rm(f"{target}/{MANIFEST}")
        self._remove(target)
        return existed

    def _write_manifest(self, p: TinkerPath, m: Manifest) -> None:
        write_whole(self.fs, f"{self.dir_of(p)}/{MANIFEST}", m.to_json())  # the old manifest or the new one

    def _remove(self, target: str) -> None:
        try:
            if self.fs.exists(target):
                self.fs.rm(target, recursive=True)
        except FileNotFoundError:
            pass


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A local scratch directory for one checkpoint's payload, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="tinkerflow-ckpt-") as d:
        yield Path(d)


def now_rfc3339() -> str:
    return rfc3339(datetime.now(UTC))
