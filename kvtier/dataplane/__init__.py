"""The local data plane: KV bytes between an engine and the daemon of its node through shared
memory, while gRPC stays the control plane (auth, lookup, the per-call gate). Both ends live here:

- ``region``: a shared-memory region (memfd), mapped by both sides; ``slices``: its allocator;
  ``typed_views``: tensors over its bytes; ``handshake``: how a region's descriptor crosses the
  unix socket;
- engine end: ``session`` (the client's link to the daemon's data plane: region, pages, fallback
  to inline gRPC), ``layered_read`` (a Get laid out layer by layer, handed over as layers land),
  ``shared_pages`` (the engine's own KV pages moved into shared memory, so the daemon writes there);
- daemon end: ``listener`` (accepts regions on the socket), ``region_table`` (regions per
  credential, with limits), ``region_writer`` (where a Get's blocks are placed in a region).
"""
