"""Measurements of trained models, used by the benches and the tests."""
