"""Benchmark harness; each module is also a `kvtier bench` subcommand."""
