"""A real transformer computed with torch: model specs and a timed prefill runner."""
