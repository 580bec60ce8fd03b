"""The names the daemon and its clients agree on: the service's full gRPC name and the
metadata keys of a call."""

from kvtier.rpc import kvtier_pb2 as pb

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["KvCache"].full_name
#: ``Bearer <capability token>``: who is calling.
AUTH_METADATA = "authorization"
#: The request salt an engine credential acts for (kvtier.security.salts).
SALT_METADATA = "kvtier-salt"
#: The handle of the caller's shared-memory region (``DataPlane``): Get writes payloads into it,
#: Put reads them from it.
REGION_METADATA = "kvtier-region"
#: ``1``: a Put returns only once its blocks are in the daemon's first durable tier (LMDB), not
#: merely in RAM (kvtier.store.tiered_store: ``put(durable=True)``).
DURABLE_METADATA = "kvtier-durable"
