"""Evaluation: datasets (FollowIR, MAIR, BRIGHT, BEIR, synthetic), metrics, scoring tasks, output files."""
