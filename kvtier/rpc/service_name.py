"""The KvCache service's full gRPC name, shared by the daemon and its clients."""

from kvtier.rpc import kvtier_pb2 as pb

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["KvCache"].full_name
