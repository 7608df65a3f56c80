"""Helpers for tests, demos and adapter authors: tiny models, strategies, conformance suites."""
