"""Three-phase KV scheduling (device / host / recompute): pure Python and pulp, no torch.

``solve(hardware, model, workload) -> Plan`` places the kept KV of every step bucket; ``evaluate``
costs a fixed placement. See ``scheduler.cost`` for the model and ``scheduler.lp`` for the LP.
"""

from scheduler.budget import KeepRule, layers_kept, mean_kept
from scheduler.cost import CostModel, activation_bytes, gathered_layers, make_buckets
from scheduler.hardware import PRESETS, HardwareProfile, load_profile, preset
from scheduler.lp import Options, build_lp, evaluate, solve
from scheduler.model import MODEL_PRESETS, ModelSpec, model_preset
from scheduler.plan import BucketPlan, Plan
from scheduler.workload import Workload

__all__ = [
    "MODEL_PRESETS",
    "PRESETS",
    "BucketPlan",
    "CostModel",
    "activation_bytes",
    "gathered_layers",
    "HardwareProfile",
    "KeepRule",
    "ModelSpec",
    "Options",
    "Plan",
    "Workload",
    "build_lp",
    "evaluate",
    "layers_kept",
    "load_profile",
    "make_buckets",
    "mean_kept",
    "model_preset",
    "preset",
    "solve",
]
