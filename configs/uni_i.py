"""InF-Embed objective `uni_i` (univariate over the marginal sets of I).

Presets: `configs/uni_i.py` (embedded MiniLM on the synthetic corpus, offline),
`configs/uni_i.py:e5-base-v2` and the other names in infjax.config.PRESETS.
"""
from infjax.config import base_config


def get_config(arg=None):
    return base_config("uni_i", arg)
