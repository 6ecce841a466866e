"""Speculation: proposers, sampling, verification (greedy, rejection sampling, token trees) and token trees
(docs/design.md, "Speculation")."""
