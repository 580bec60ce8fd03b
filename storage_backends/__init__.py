"""Tier implementations: memory, LMDB, GPU, S3 (its own package) and the daemon's client tier.

The daemon and the command line find them by name through the ``kvtier.backends`` entry points
(kvtier/plugins.py), never by import.
"""

from kvtier.aliases import alias_modules

# Moved in 0.2 (the data plane to kvtier/dataplane/, security stores to kvtier/security/, S3 into
# its own package); the old paths work until the next release.
alias_modules({
    "storage_backends.shm_link": "kvtier.dataplane.session",
    "storage_backends.layer_major": "kvtier.dataplane.layered_read",
    "storage_backends.domain_table": "kvtier.security.domain_table",
    "storage_backends.s3_config": "storage_backends.s3.config",
    "storage_backends.s3_breaker": "storage_backends.circuit_breaker",
    "storage_backends.s3.breaker": "storage_backends.circuit_breaker",
    "storage_backends.s3_probes": "storage_backends.s3.probes",
    "storage_backends.s3_objects": "storage_backends.s3.objects",
    "storage_backends.s3_keys": "storage_backends.s3.key_mirror",
    "storage_backends.s3_revocations": "storage_backends.s3.revocation_feed",
})
