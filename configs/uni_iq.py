"""InF-Embed objective `uni_iq` (univariate over the marginal sets of IQ).

Presets: `configs/uni_iq.py` (embedded MiniLM on the synthetic corpus, offline),
`configs/uni_iq.py:e5-base-v2` and the other names in infjax.config.PRESETS.
"""
from infjax.config import base_config


def get_config(arg=None):
    return base_config("uni_iq", arg)
