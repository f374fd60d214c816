"""What clients talk to: the vericache.v1 gRPC service and the OpenAI-compatible HTTP API, API
keys and tenants, admission, prompts and automatic prefixes, and the coordinator that checks
every call and hands it to a backend. Imports backends/ and everything below it."""
