"""The S3-compatible remote tier and what lives in its bucket beside the blocks.

- ``tier``: ``S3Tier`` (blocks as objects); ``seaweed_vacuum``: ``SeaweedVacuum`` (compaction
  after a purge, for SeaweedFS);
- ``config``: ``S3Config`` and the object names; ``probes``: how a chain's longest stored prefix
  is found; ``objects``: the small-object client shared by the two stores below (the circuit
  breaker is storage_backends/circuit_breaker.py, shared with the daemon tier);
- ``key_mirror``: the node's wrapped data keys, mirrored for the other nodes of the bucket, and
- ``revocation_feed``: the revocations every node of the bucket follows (``feed_state``: what of
  it a node keeps on its own disk across restarts).

The daemon finds this package through the ``kvtier.backends`` entry point ``s3``.
"""

from storage_backends.s3.config import S3Config
from storage_backends.s3.feed_state import FeedState
from storage_backends.s3.key_mirror import S3WrappedKeyStore
from storage_backends.s3.revocation_feed import S3RevocationFeed
from storage_backends.s3.seaweed_vacuum import SeaweedVacuum
from storage_backends.s3.tier import S3Tier, S3Timeout, S3Unreachable

__all__ = ["FeedState", "S3Config", "S3RevocationFeed", "S3Tier", "S3Timeout", "S3Unreachable", "S3WrappedKeyStore",
           "SeaweedVacuum"]
