"""The node's image cache: the store of its entries, pulls (downloads, tag
coalescing, OCI-to-SIF conversion), the keep list and eviction."""
