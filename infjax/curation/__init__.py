"""Curation of InF-IR-style training data from (query, passage) pairs (paper §4.1, Appendix B).

sources   (query, passage) pairs and their passage collection: a BEIR folder, a jsonl of pairs, a hub id
prompts   the versioned prompt templates (package data) and their rendering
parse     strict parsing of each stage's answer format
backends  an OpenAI-compatible HTTP client (retries, cache, token accounting) and the local Flax decoder
stages    instruct, poison, negatives, clean, verify: resumable, one append-only file per stage
pipeline  running the stages, writing the InF-IR files and the report

Layer: above evaluation (it reads BEIR folders with evaluation's reader); only `infjax.curate` imports it.
"""
