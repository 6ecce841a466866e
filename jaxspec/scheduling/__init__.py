"""Scheduling: request values and validation, the continuous-batching loop, output processing, detokenising
(docs/design.md, "One request's way through")."""
