"""The runtime directory (``schema.naming.runtime_dir``: mode 0700, 0711 with ``--allow-uid``) and the sockets in it."""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

from shmrpc.schema.naming import attach_path, runtime_dir, socket_path

from .checks import StartupError

__all__ = ["admit_to_socket", "check_runtime_dir", "ensure_runtime_dir", "remove_socket"]


def check_runtime_dir(path: Path) -> str | None:
    """Why ``path`` is not a safe runtime directory (``None`` when it is: a real directory, ours, that no other uid
    may list or change: mode 0700, or 0711, where others may pass through to the sockets, whose own modes decide who
    connects; a worker with ``--allow-uid`` makes it 0711, and one without takes it as it is, 0600 sockets and all,
    so workers with and without ``--allow-uid`` can share one directory).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return (
            f"runtime directory {path} is not a directory: remove it, or set SHMRPC_RUNTIME_DIR to a private directory"
        )
    if st.st_uid != os.geteuid():
        return (
            f"runtime directory {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
            "remove it, or set SHMRPC_RUNTIME_DIR to a private directory"
        )
    if st.st_mode & 0o066:
        return (
            f"runtime directory {path} has mode {stat.S_IMODE(st.st_mode):04o}, so other users can reach "
            f"the worker: run chmod 700 {path}, or set SHMRPC_RUNTIME_DIR to a private directory"
        )
    return None


def ensure_runtime_dir(*, shared: bool = False) -> Path:
    """Create the runtime directory (mode 0700; 0711 when ``shared``, for ``--allow-uid``) or check the existing one.

    Returns:
        The directory, :func:`shmrpc.schema.naming.runtime_dir`.

    Raises:
        StartupError: it exists but is not a directory, not ours, or group/other can list or change it.

    Example:
        >>> path = ensure_runtime_dir()
    """
    path = runtime_dir()
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = 0o711 if shared else 0o700
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(path, mode)  # mkdir's mode passes through the umask; make it exact
    problem = check_runtime_dir(path)
    if problem:
        raise StartupError(problem)
    if shared and stat.S_IMODE(os.lstat(path).st_mode) != mode:
        os.chmod(path, mode)  # ours and private: open it to passing through, never to listing
    return path


def remove_socket(name: str) -> bool:
    """Unlink the socket files (ZeroMQ and attach) of worker ``name``; returns whether there was one."""
    removed = False
    for path in (socket_path(name), attach_path(name)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed = True
    return removed


# a POSIX access ACL as the kernel stores it (linux/posix_acl_xattr.h): a version, then (tag, perm, id) entries
# sorted by tag, then id
_ACL_VERSION, _UNDEFINED_ID = 2, 0xFFFFFFFF
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_RW = 6


def admit_to_socket(path: Path, uids: tuple[int, ...]) -> bool:
    """Let the users ``uids`` (``--allow-uid``) connect to the socket file at ``path``, and no other uid: mode 0600
    plus an access ACL entry ``user:UID:rw`` for each (``ls -l`` shows 0660: the ACL's mask). A uid that may not
    connect is stopped by the kernel at ``connect`` (EACCES), before the worker holds anything for it; with the
    socket open to all, every connection took a file descriptor in the worker first, and enough of them on the
    ZeroMQ socket made libzmq abort the worker at EMFILE.

    Returns:
        False where the file system keeps no ACLs: the socket is then made 0666 (the worker's own checks on the
        attach socket and the session token still decide who is served) and the caller says so.
    """
    entries = [(_USER_OBJ, _RW, _UNDEFINED_ID), *((_USER, _RW, u) for u in sorted(set(uids)) if u != os.geteuid()),
               (_GROUP_OBJ, 0, _UNDEFINED_ID), (_MASK, _RW, _UNDEFINED_ID), (_OTHER, 0, _UNDEFINED_ID)]
    acl = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)
    os.chmod(path, 0o600)
    try:
        os.setxattr(path, "system.posix_acl_access", acl, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
        os.chmod(path, 0o666)
        return False
    return True
