"""Storage tiers. Each module implements kvtier.tier.Tier for one kind of storage."""
