"""KV caches: dense (cache.py), compressed (compressed.py), quantized (quantized.py), their wire
format (codec.py), and the slots a request reserves (slots.py, torch-free for the simulator).
Import from the modules: the package imports nothing, so that slots.py needs no torch."""
