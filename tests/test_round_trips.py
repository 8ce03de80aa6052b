"""The decode step is GPU-shaped: host round trips per layer and step, counted on a CPU.

A data-dependent read of a device tensor (``.item()``, ``int(t)``, ``bool(t)``: the op
``aten::_local_scalar_dense``; ``nonzero`` and the other ops whose output shape depends on the
values) stalls a CUDA device until its queue drains. The budget (issue 26): at most one per layer
and decode step with ``retention="host"`` (its fetch list), none when dropping, beyond what
Hugging Face's own loop does with a ``DynamicCache``. Host configs here select at every step
(``reselect_every=1``), so each counted step pays for a selection, through the PyTorch ops a
CUDA device runs (``compiled=False``).

On a CPU these ops still go through the dispatcher, so a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` counts them; under inference mode it
sees the composite ops (``aten::item``, ``aten::is_nonzero``, ``aten::nonzero_numpy``), so both
levels are counted.
"""

from collections import Counter
from functools import partial

import pytest
from conftest import forced_ops, padded_batch, tiny_llama, watched_decode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from alisa import AlisaCache, AlisaConfig
from alisa.kv.cache import default_keeper
from alisa.storage.pages import PAGE_TOKENS

# Ops that make the host wait for the device's values.
DATA_DEPENDENT = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::nonzero",
        "aten::nonzero_numpy",
        "aten::nonzero_static",
        "aten::masked_select",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::unique_dim",
        "aten::repeat_interleave",
        "aten::argwhere",
    }
)
# One page of new tokens (PAGE_TOKENS) per counted window: host pages are coded once in it.
WARM_UP, STEPS = 3, 16


class RoundTrips(TorchDispatchMode):
    """Counts the data-dependent ops dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in DATA_DEPENDENT:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def decode_round_trips(model, cache, ids, mask) -> Counter[str]:
    """Data-dependent ops of STEPS greedy decode steps, after the prefill and WARM_UP steps."""
    counter = RoundTrips()
    watched_decode(model, cache, ids, mask, counter, warm_up=WARM_UP, steps=STEPS)
    return counter.counts


@pytest.mark.parametrize(
    ("config", "allowed"),
    [
        pytest.param(
            AlisaConfig(policy="swa", budget_tokens=24, min_budget_tokens=0), 0, id="drop-swa"
        ),
        pytest.param(
            AlisaConfig(policy="h2o", budget_tokens=24, min_budget_tokens=0), 0, id="drop-h2o"
        ),
        pytest.param(
            AlisaConfig(policy="swa", caching_ratio=0.3, min_budget_tokens=0, kv_bits=8),
            1,
            id="drop-int8",
        ),
        pytest.param(
            AlisaConfig(policy="swa", budget_tokens=24, min_budget_tokens=0, per_head=True),
            0,
            id="drop-per-head",
        ),
        pytest.param(
            AlisaConfig(
                policy="swa",
                budget_tokens=24,
                min_budget_tokens=0,
                retention="host",
                reselect_every=1,
            ),
            1,
            id="host-swa",
        ),
        pytest.param(
            AlisaConfig(
                policy="swa",
                budget_tokens=24,
                min_budget_tokens=0,
                retention="host",
                reselect_every=1,
                history_share=0.5,
            ),
            1,
            id="host-history",
        ),
        pytest.param(
            AlisaConfig(
                policy="swa",
                caching_ratio=0.3,
                min_budget_tokens=0,
                retention="host",
                reselect_every=1,
                kv_bits=8,
            ),
            # Gap: an INT8 device region adds the quantizer's check that each new token's
            # zero point fits the fp16 scale dtype (one per layer and step, both retentions).
            2,
            id="host-int8",
        ),
    ],
)
@pytest.mark.parametrize("lengths", [(60, 60), (60, 47)], ids=["equal", "padded"])
def test_round_trips_per_layer_and_step(config, allowed, lengths):
    model = tiny_llama()
    layers = model.config.num_hidden_layers
    ids, mask = padded_batch(lengths=lengths)
    baseline = decode_round_trips(model, DynamicCache(), ids, mask)
    # The PyTorch path is the one a CUDA device runs (on a CPU host retention's choice, slot
    # swap and history are compiled kernels, which read host memory and never wait).
    cache = AlisaCache(model, config, keeper=partial(default_keeper, ops=forced_ops()))
    counts = decode_round_trips(model, cache, ids, mask)
    extra = counts.total() - baseline.total()
    # Gap: coding a page of new tokens into an INT8/INT4 host region checks, once per layer
    # and page, that the quantizer's zero points fit their dtype.
    paging = layers if config.retention == "host" and config.host_bits < 16 else 0
    assert STEPS == PAGE_TOKENS
    assert extra <= allowed * layers * STEPS + paging, (counts, baseline)
