"""Shared pytest configuration: fixture plugins used across the suites."""

pytest_plugins = ["tests.fixtures_s3"]
