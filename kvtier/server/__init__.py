"""The daemon: configuration, authentication, limits, the gRPC service and its observability."""

from kvtier.aliases import alias_modules

# Moved in 0.2 to kvtier/dataplane/ (both ends of the shared-memory protocol live there); the old
# paths work until the next release.
alias_modules({
    "kvtier.server.data_plane": "kvtier.dataplane.listener",
    "kvtier.server.region_table": "kvtier.dataplane.region_table",
    "kvtier.server.region_writer": "kvtier.dataplane.region_writer",
})
