"""Serving: the pieces of the distributed system (link, stores, drafters, verifiers, API)."""
