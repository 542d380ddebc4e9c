"""InF-Embed objective `multi_iiq` (multivariate over the marginal sets of IIQ).

Presets: `configs/multi_iiq.py` (embedded MiniLM on the synthetic corpus, offline),
`configs/multi_iiq.py:e5-base-v2` and the other names in infjax.config.PRESETS.
"""
from infjax.config import base_config


def get_config(arg=None):
    return base_config("multi_iiq", arg)
