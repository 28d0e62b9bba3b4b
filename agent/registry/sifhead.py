"""What a SIF artifact holds, read at submit from the blob's first bytes (a Range
request: the header and descriptor table, never the image), so that a SIF tfimage
cannot run is refused with one line before anything is queued, rather than failing
in every step (core/sif.py's ``Layout.unfit`` names the kinds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tfimage.agent.core.errors import VerificationError
from tfimage.agent.core.sif import DESCRIPTOR_SIZE, MAX_DESCRIPTORS, layout, table_end
from tfimage.agent.registry.artifact import SifLayer

if TYPE_CHECKING:
    from tfimage.agent.registry.client import RegistryClient

# siftool and Apptainer put 48 descriptors at 4096: the table ends at 32176 bytes.
HEAD_BYTES = 64 << 10
# The most a header can make us read: every descriptor the parser accepts.
MAX_HEAD = 4096 + MAX_DESCRIPTORS * DESCRIPTOR_SIZE


def _first(client: RegistryClient, repository: str, layer: SifLayer, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    with client.open_blob(repository, layer.digest, 0, n, layer.size, whole_ok=True) as r:
        while got < n and (k := r.readinto(view[got:])):
            got += k
    return bytes(buf[:got])


def unfit(client: RegistryClient, repository: str, layer: SifLayer, arch: str) -> str | None:
    """Why the SIF ``layer`` cannot run on ``arch``, or None; a VerificationError
    where its first bytes are not a SIF's."""
    head = _first(client, repository, layer, min(layer.size, HEAD_BYTES))
    end = table_end(head)
    if end > len(head):
        if end > min(layer.size, MAX_HEAD):
            raise VerificationError("SIF descriptor table runs past the end of the file")
        head = _first(client, repository, layer, end)
    return layout(head, layer.size).unfit(arch)
