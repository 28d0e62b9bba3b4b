"""Submit side: pinning a tag to its digest, and the last digests seen for outages."""
