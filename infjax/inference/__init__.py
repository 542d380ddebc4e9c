"""Inference: trained encoders as text -> embedding functions, an embedding cache, exact search, model sources."""
