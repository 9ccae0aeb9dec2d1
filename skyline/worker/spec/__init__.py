"""Speculative decoding on the worker: proposers (n-gram, suffix, EAGLE head, draft model) and
verification of their drafts."""
