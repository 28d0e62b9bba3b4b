"""The registry side: the OCI distribution client, its transports, credentials
and the shape of a SIF artifact."""
