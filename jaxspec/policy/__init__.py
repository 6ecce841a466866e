"""Speculation policies: choose k (or per-row k) every step."""
