"""The local data plane: KV bytes between an engine and the daemon of its node through shared
memory, while gRPC stays the control plane (auth, lookup, the per-call gate)."""
