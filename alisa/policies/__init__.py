"""KV policies (:mod:`.registry` maps names to classes); one short file per policy.

The classes load on first use (``lazy_loader``): each imports torch, and ``alisa.config``, which
the CLI's parser reads for its flags, must import without it so that ``alisa --help`` is quick.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "base": ["KVPolicy"],
        "dense": ["DensePolicy"],
        "h2o": ["H2OPolicy"],
        "layer_schedule": ["PYRAMID_BETA", "layer_budget_scale"],
        "local": ["LocalPolicy"],
        "registry": ["POLICIES", "get_policy"],
        "streaming": ["StreamingPolicy"],
        "strided": ["StridedPolicy"],
        "swa": ["SWAPolicy"],
        "tova": ["TOVAPolicy"],
    },
)
