"""The prefixes' full KV at rest: the full-KV store (LMCache's local disk backend, or files), the
catalog of registered prefixes, the per-chunk digests every read is checked against, and the
staging of a registration under way. Imports only serve's shared modules (api_types, config)."""
