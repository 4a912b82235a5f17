"""Generated stubs of the ``meridian.v1`` gRPC API (``make protos``); do not edit by hand."""
