"""alisa: LLM inference when KV-cache memory is the wall.

ALISA sparse window attention (https://arxiv.org/abs/2403.17312) and baseline KV policies inside
Hugging Face ``generate``, INT8 KV storage and three-phase offload/recompute scheduling.
"""

from alisa.config import AlisaConfig
from alisa.jobs import BatchJob, JobSummary, run_batch
from alisa.kv.cache import AlisaCache
from alisa.kv.hooks import attach, attached, detach
from alisa.model.loading import load_model
from alisa.policies import POLICIES, KVPolicy, get_policy
from alisa.runtime.generate import GenerationOutput, SamplingOptions, generate

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "AlisaCache",
    "AlisaConfig",
    "BatchJob",
    "JobSummary",
    "GenerationOutput",
    "KVPolicy",
    "SamplingOptions",
    "attach",
    "attached",
    "detach",
    "generate",
    "get_policy",
    "load_model",
    "run_batch",
]
