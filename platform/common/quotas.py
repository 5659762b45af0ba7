"""The quota file: quotas and rate limits per API key, in TOML, read when the API starts and again on SIGHUP.

```toml
[default]                            # every key not named below
training_tokens_per_day = 50_000_000
sampling_tokens_per_day = 200_000_000
sampling_tokens_per_minute = 2_000_000
concurrent_runs = 16
stored_gb = 100

[keys."tml-alice"]                   # an accepted API key ...
training_tokens_per_day = 500_000_000

[keys."3f9a0c1d2e4b5a6c"]            # ... or its key id (billing's user_id, /metrics' tenant label)
concurrent_runs = "unlimited"
```

A field a key's section leaves out is the default section's; one the default section leaves out has no limit. A limit
is a whole number >= 0 (`stored_gb` may have a fraction), or "unlimited", which lifts the default's limit for one key;
0 allows nothing. What each quota counts and how a request past it is refused is platform/api/quota_checks.py's
(docs/operations.md §Quotas). This module only reads the file: every problem is a QuotaFileError naming the file, the
line and what could not be read.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NoReturn

from tinkerflow.common.errors import UserError

UNLIMITED = "unlimited"
MAX_FILE_BYTES = 1 << 20
MAX_LIMIT = 2**63 - 1
KEY_ID = re.compile(r"[0-9a-f]{16}")  # tinkerflow.common.tenancy.key_id


@dataclass(frozen=True)
class Limits:
    """One key's limits; None: no limit."""

    training_tokens_per_day: int | None = None
    sampling_tokens_per_day: int | None = None
    sampling_tokens_per_minute: int | None = None
    concurrent_runs: int | None = None
    stored_gb: float | None = None


QUOTAS = tuple(f.name for f in fields(Limits))
FRACTIONAL = {"stored_gb"}
Section = dict[str, int | float | None]  # the fields a section sets; None is "unlimited"


class QuotaFileError(UserError):
    """A quota file that cannot be read: refused at start (the CLI exits 2), kept out on SIGHUP."""

    def __init__(self, message: str, path: str = "", line: int | None = None):
        super().__init__(message)
        self.path, self.line = path, line


def _error(path: str, line: int | None, what: str) -> QuotaFileError:
    where = f"quota file {path}" + (f", line {line}" if line else "")
    return QuotaFileError(f"{where}: {what}", path, line)


@dataclass(frozen=True)
class QuotaFile:
    path: str
    default: Section = field(default_factory=Section)
    keys: dict[str, Section] = field(default_factory=dict[str, Section])  # section name -> what it sets
    lines: dict[str, int] = field(default_factory=dict[str, int])  # section name -> its line

    def limits(self, section: Section | None = None) -> Limits:
        merged = {**self.default, **(section or {})}
        return Limits(**merged)  # pyright: ignore[reportArgumentType] (each value checked by _limit)

    def by_key_id(self, key_id: Callable[[str], str], accepted: Collection[str]) -> dict[str, Limits]:
        """Each named key's limits by key id: a section names an accepted API key (resolved with `key_id`) or a key
        id; QuotaFileError for a name that is neither, or two names of one key."""
        out: dict[str, Limits] = {}
        seen: dict[str, str] = {}
        for name, section in self.keys.items():
            line = self.lines.get(name)
            if name in accepted:
                owner = key_id(name)
            elif KEY_ID.fullmatch(name):
                owner = name
            else:
                raise _error(
                    self.path,
                    line,
                    f"[{_dotted(('keys', name))}] names neither an API key this server accepts (--api-key, "
                    "--api-keys-file) nor a key id (16 hex digits, as billing's user_id and /metrics show it)",
                )
            if owner in seen:
                raise _error(
                    self.path,
                    line,
                    f"[{_dotted(('keys', name))}] names the same key as [{_dotted(('keys', seen[owner]))}]",
                )
            seen[owner] = name
            out[owner] = self.limits(section)
        return out


def load(path: str) -> QuotaFile:
    """Read and check a quota file; QuotaFileError says where and what when it cannot."""
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise _error(path, None, f"cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise _error(path, None, f"it is {len(data):,} bytes, more than a quota file's {MAX_FILE_BYTES:,}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _error(path, data[: e.start].count(b"\n") + 1, "not UTF-8 text") from None
    return parse(text, path)


def parse(text: str, path: str) -> QuotaFile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        found = re.search(r"at line (\d+)", str(e))
        raise _error(path, int(found.group(1)) if found else None, f"not valid TOML: {e}") from None
    index = _line_index(text)

    def fail(where: tuple[str, ...], what: str) -> NoReturn:
        raise _error(path, _locate(index, where), f"{_dotted(where)}: {what}")

    for name in doc:
        if name not in ("default", "keys"):
            fail((name,), 'not a quota file section: it has [default] and [keys."<API key or key id>"]')
    default = _section(doc.get("default", {}), ("default",), fail)
    keys = doc.get("keys", {})
    if not isinstance(keys, dict):
        fail(("keys",), 'must hold one table per key: [keys."<API key or key id>"]')
    sections = {str(name): _section(body, ("keys", str(name)), fail) for name, body in keys.items()}
    lines = {name: line for name in sections if (line := _locate(index, ("keys", name)))}
    return QuotaFile(path, default, sections, lines)


def _section(body: Any, where: tuple[str, ...], fail: Callable[[tuple[str, ...], str], NoReturn]) -> Section:
    if not isinstance(body, dict):
        fail(where, f"must be a table of limits ({', '.join(QUOTAS)}), got {_kind(body)}")
    out: Section = {}
    for name, value in body.items():
        if name not in QUOTAS:
            fail((*where, name), f"not a quota; the quotas are {', '.join(QUOTAS)}")
        out[name] = _limit(value, name, (*where, name), fail)
    return out


def _limit(value: Any, name: str, where: tuple[str, ...], fail: Callable[[tuple[str, ...], str], NoReturn]):
    if value == UNLIMITED:
        return None
    fractional = name in FRACTIONAL
    number = isinstance(value, int) or (fractional and isinstance(value, float))
    if isinstance(value, bool) or not number or not math.isfinite(value) or not 0 <= value <= MAX_LIMIT:
        wanted = "a number" if fractional else "a whole number"
        fail(where, f'expected {wanted} from 0 to 2**63-1 or "{UNLIMITED}", got {_kind(value)}')
    return value


def _kind(value: Any) -> str:
    if isinstance(value, bool | int | float):
        return repr(value).lower() if isinstance(value, bool) else repr(value)
    if isinstance(value, str):
        return f"the string {_shown(value)}"
    return {dict: "a table", list: "an array"}.get(type(value), type(value).__name__)


def _shown(name: str) -> str:
    """A name as a message shows it: quoted, and cut short unless a key id (a section may be named by a secret API
    key, and messages reach logs)."""
    short = KEY_ID.fullmatch(name) or len(name) <= 8
    return json.dumps(name if short else name[:8] + "…", ensure_ascii=False)


def _dotted(where: tuple[str, ...]) -> str:
    """A TOML key path as the file would spell it, a key's name always quoted and cut short:
    `keys."tml-alice".concurrent_runs`."""
    named = where[:1] == ("keys",)
    return ".".join(
        _shown(w) if (named and i == 1) or not re.fullmatch(r"[A-Za-z0-9_-]+", w) else w for i, w in enumerate(where)
    )


def _line_index(text: str) -> dict[tuple[str, ...], int]:
    """The line of each table header and key of a TOML text (the first, for the lines that parse on their own)."""
    index: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), 1):
        try:
            doc = tomllib.loads(line)
        except tomllib.TOMLDecodeError:
            continue
        paths = list(_paths(doc))
        if line.lstrip().startswith("["):
            table = max(paths, key=len, default=())
            index.setdefault(table, number)
        else:
            for p in paths:
                index.setdefault(table + p, number)
    return index


def _paths(doc: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield (*prefix, str(k))
            yield from _paths(v, (*prefix, str(k)))


def _locate(index: dict[tuple[str, ...], int], where: tuple[str, ...]) -> int | None:
    for n in range(len(where), 0, -1):
        if where[:n] in index:
            return index[where[:n]]
    return None
