"""The manifest media types of the OCI image spec and of Docker's registry API.

The distribution client (client.py) asks for and pushes these; the SIF artifact's
shape (artifact.py) is an OCI image manifest.  They stand here, apart from both,
because client.py builds its SIF pushes from artifact.py: the artifact's module
must not import the client's.
"""

from __future__ import annotations

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
# A manifest that lists one manifest per platform.
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
