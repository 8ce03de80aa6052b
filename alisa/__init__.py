"""alisa: LLM inference when KV-cache memory is the wall.

ALISA sparse window attention (https://arxiv.org/abs/2403.17312) and baseline KV policies inside
Hugging Face ``generate``, INT8 KV storage and three-phase offload/recompute scheduling.

The public names load on first use (``lazy_loader``): most of them import torch and
transformers, which the CLI needs only once a command runs, not for ``alisa --help``.
"""

import lazy_loader

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "config": ["AlisaConfig"],
        "jobs": ["BatchJob", "JobSummary", "run_batch"],
        "jobs.stream": ["stream_generate"],
        "kv.cache": ["AlisaCache"],
        "kv.attention": ["attach", "attached", "detach"],
        "model.loading": ["load_model"],
        "policies": ["POLICIES", "KVPolicy", "get_policy"],
        "runtime.generate": ["GenerationOutput", "SamplingOptions", "generate"],
        "runtime.requests": ["StreamRequest", "StreamResult"],
        "threads": ["use_threads"],
    },
)
