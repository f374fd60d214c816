"""VeriCache: lossless LLM inference over lossy compressed KV caches."""

__version__ = "0.1.0"
