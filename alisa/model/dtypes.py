"""Weight dtype names of ``--dtype`` and :func:`alisa.model.loading.load_model`.

Names only (torch attribute names, ``None`` for the checkpoint's own), so the CLI's parser can
list them without importing torch.
"""

from __future__ import annotations

DTYPES: dict[str, str | None] = {
    "auto": None,
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
