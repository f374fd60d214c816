"""Generated gRPC stubs of the vericache.v1 API (proto/vericache/v1/): run `make proto`."""
