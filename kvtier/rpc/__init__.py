"""The wire: the gRPC protocol, its frame codec and the one error<->status table."""
