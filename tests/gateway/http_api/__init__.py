"""The gateway's OpenAI-compatible HTTP API and /metrics (a package: its two stacks start once for all
of its files, conftest.py)."""
