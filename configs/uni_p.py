"""InF-Embed objective `uni_p` (univariate over the marginal sets of P).

Presets: `configs/uni_p.py` (embedded MiniLM on the synthetic corpus, offline),
`configs/uni_p.py:e5-base-v2` and the other names in infjax.config.PRESETS.
"""
from infjax.config import base_config


def get_config(arg=None):
    return base_config("uni_p", arg)
