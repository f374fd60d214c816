"""Low-level KV ops. Each has a pure-torch reference that runs on CPU and CUDA."""
