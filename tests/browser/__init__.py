"""Helpers for tests that drive JupyterLab in a real browser."""
