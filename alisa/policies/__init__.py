"""KV policies (:mod:`.rules`: one class per policy, the registry, the step's budget book) and
the budget's schedule across layers (:mod:`.layer_schedule`).

The classes load on first use (``lazy_loader``): they import torch, and ``alisa.config``, which
the CLI's parser reads for its flags, must import without it so that ``alisa --help`` is quick.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "layer_schedule": ["PYRAMID_BETA", "layer_budget_scale"],
        "rules": [
            "POLICIES",
            "BudgetBook",
            "DensePolicy",
            "H2OPolicy",
            "KVPolicy",
            "LocalPolicy",
            "StepShares",
            "StreamingPolicy",
            "StridedPolicy",
            "SWAPolicy",
            "TOVAPolicy",
            "get_policy",
        ],
    },
)
