"""The node's image cache: the store, downloads, tag coalescing, eviction and
OCI-to-SIF conversion."""
