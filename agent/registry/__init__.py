"""The registry side of tfimage.

- ``client``: the OCI distribution client (manifests, blobs, tags, pushes).
- ``auth``: how the client authenticates (Basic, the Bearer token flow, tokens by scope).
- ``artifact``: the SIF artifact's manifest shape (Apptainer's ORAS format), checked
  and built.
- ``mediatypes``: the OCI and Docker manifest media types both of those use.
- ``transport``: the HTTP transports under the client, their redirect rules, and
  reading their answers.
- ``credentials``: the registry credentials files.
- ``access``: a client for a host, with this node's (or this user's) credentials.
"""
