"""Metrics JSONL -> tables (markdown) and plots (matplotlib PNG)."""
