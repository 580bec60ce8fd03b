"""Planning: the cost model that decides, per request, whether to reload or recompute."""
