"""Storage faults told apart from bugs: an OS error of the storage itself (read-only, full, permission) anywhere in
an exception's chain, in words an operator acts on. Used by the API (503 naming the store) and the JAX worker (a
failed save that says the checkpoint store refused it, instead of "engine error" and an internal path)."""

from __future__ import annotations

import errno

# FileNotFoundError is a missing object, not a storage fault: it is not here.
STORAGE_ERRNOS = {
    errno.EROFS: "its file system is read-only",
    errno.ENOSPC: "its disk is full",
    errno.EDQUOT: "its disk quota is exhausted",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "an I/O error",
}


def chain(e: BaseException | None):
    """`e`, then what caused it, and so on (each exception once)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def storage_fault(e: BaseException) -> str | None:
    """'its disk is full' when `e` (or what caused it) is an OS error of storage itself, else None."""
    for link in chain(e):
        if isinstance(link, OSError) and link.errno in STORAGE_ERRNOS:
            return STORAGE_ERRNOS[link.errno]
    return None
