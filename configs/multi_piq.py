"""InF-Embed objective `multi_piq` (multivariate over the marginal sets of PIQ).

Presets: `configs/multi_piq.py` (embedded MiniLM on the synthetic corpus, offline),
`configs/multi_piq.py:e5-base-v2` and the other names in infjax.config.PRESETS.
"""
from infjax.config import base_config


def get_config(arg=None):
    return base_config("multi_piq", arg)
