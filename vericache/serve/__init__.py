"""Serving: the distributed system (and the single-process long-context server) behind the
vericache.v1 gRPC API and the OpenAI-compatible HTTP API.

Its parts, each a package that may import only the ones listed before it (tests/test_serve_layout.py
holds this):
- this package's own modules: the records every part shares: the API's types (api_types.py), the
  settings of every part (config.py), the cluster's secret (cluster_secret.py) and logging;
- store/: the prefixes' full KV at rest: the store, its catalog, chunk digests, staging;
- workers/: the verifier and drafter workers, their typed calls (worker_api.py), the handles the
  coordinator calls them through, their batch loops, the KV transfer between them and the
  verifier's prefix copies;
- backends/: where and how a request runs: placement and auto's paths, its rounds and their
  schedules, migrations, the coordinator's metrics; the distributed and long-context backends;
- front/: what clients talk to: the gRPC and OpenAI APIs, auth and tenants, admission, prompts,
  automatic prefixes, and the coordinator that ties them to a backend;
- launch/: starting it all: in-process or Ray workers, the background server.
"""
