"""The model-zoo tests use the fixtures of tests/conftest.py (shared data, no downloads)."""
