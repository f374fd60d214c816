"""The workers: verifiers (full KV beside the store) and drafters (compressed KV across the slow
link, warm nodes with a host tier), their typed calls (worker_api.py), the handles the
coordinator calls them through (in this process or as Ray actors), their continuous batch loops,
and the KV transfer between them. Imports store/ and serve's shared modules, never the
coordinator's side (backends/, front/) nor Ray outside handles and launch."""
