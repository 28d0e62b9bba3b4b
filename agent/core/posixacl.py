"""A POSIX access ACL that lets root and some users and groups read (or, for a
directory, traverse) a path, and nobody else: how a private image's cached file,
its metadata and a job's directory are kept to the users ``access:`` names.

The ACL is written as the kernel takes it (``system.posix_acl_access``, what
libacl's ``acl_set_fd`` writes): a version, then (tag, perm, id) entries in tag
order, named ones by id::

    u32 version = 2
    u16 tag, u16 perm, u32 id        USER_OBJ  perm  -
                                     USER      perm  uid   (each, by uid)
                                     GROUP_OBJ 0     -
                                     GROUP     perm  gid   (each, by gid)
                                     MASK      perm  -
                                     OTHER     0     -

A filesystem without ACLs (EOPNOTSUPP) leaves the path to root alone: safe, and
the caller says so once.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable

XATTR = "system.posix_acl_access"
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED = 0xFFFFFFFF
READ, EXECUTE = 4, 1
_ENTRY = struct.Struct("<HHI")


def acl_blob(uids: Iterable[int], gids: Iterable[int], perm: int, owner: int) -> bytes:
    """The xattr value granting ``perm`` to ``uids`` and ``gids``, ``owner`` to the
    file's owner, nothing to its group or to others."""
    entries = [(USER_OBJ, owner, UNDEFINED)]
    entries += [(USER, perm, u) for u in sorted(set(uids))]
    entries.append((GROUP_OBJ, 0, UNDEFINED))
    entries += [(GROUP, perm, g) for g in sorted(set(gids))]
    entries += [(MASK, perm, UNDEFINED), (OTHER, 0, UNDEFINED)]
    return struct.pack("<I", VERSION) + b"".join(_ENTRY.pack(*e) for e in entries)


def restrict(fd_or_path: int | str, uids: Iterable[int], gids: Iterable[int], *,
             directory: bool = False) -> bool:  # fmt: skip
    """Only root and ``uids``/``gids`` may read (a directory: traverse) it.  False
    where the filesystem has no ACLs: then only root may."""
    os.chmod(fd_or_path, 0o700 if directory else 0o400)
    perm = EXECUTE if directory else READ
    owner = 0o7 if directory else READ
    try:
        os.setxattr(fd_or_path, XATTR, acl_blob(uids, gids, perm, owner))
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            return False
        raise
    return True
