"""Training drafts for a target (`jaxspec distill`): the token draft and the feature draft, their data
(docs/drafts.md)."""
