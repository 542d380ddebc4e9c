"""InF-Embed objective `uni_pi` (univariate over the marginal sets of PI).

Presets: `configs/uni_pi.py` (embedded MiniLM on the synthetic corpus, offline),
`configs/uni_pi.py:e5-base-v2` and the other names in infjax.config.PRESETS.
"""
from infjax.config import base_config


def get_config(arg=None):
    return base_config("uni_pi", arg)
