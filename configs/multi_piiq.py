"""InF-Embed objective `multi_piiq` (multivariate over the marginal sets of PIIQ).

Presets: `configs/multi_piiq.py` (embedded MiniLM on the synthetic corpus, offline),
`configs/multi_piiq.py:e5-base-v2` and the other names in infjax.config.PRESETS.
"""
from infjax.config import base_config


def get_config(arg=None):
    return base_config("multi_piiq", arg)
