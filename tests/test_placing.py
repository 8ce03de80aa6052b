"""Host retention's choice and slot placement by one Triton kernel (:mod:`alisa.ops.cuda`)
equal choosing, then placing (:mod:`alisa.ops.reference`), exactly.

The kernel is compiled only on CUDA (``tests/test_cuda.py`` runs it there); here it runs in
Triton's interpreter (``TRITON_INTERPRET=1``, read when the kernel is defined, so in a process
of its own): the same program, element by element on the CPU. Random steps with many ties and
with distinct values, then whole generations against the PyTorch path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_kernels import random_choice

from alisa.ops.cuda import choose_and_place

pytest.importorskip("triton")  # installed by `make setup` on a CPU build of PyTorch

INTERPRETED = """
import dataclasses, json, sys
from functools import partial

import numpy as np
import torch

from alisa import AlisaCache, AlisaConfig
from alisa.kv.cache import default_keeper
from alisa.ops import reference
from alisa.ops.cuda import choose_and_place
from conftest import forced_ops, hf_generate, padded_batch, tiny_llama
from test_kernels import random_choice, slot_map

report = {"steps": 0, "fetched": 0, "mismatches": []}
torch.manual_seed(0)
# Blocks of 32 positions: a row spans several, so every pass carries counts across blocks;
# radix digits of 8 bits (the default) and of 4.
for seed, ties, block, digit_bits in ((5, True, 32, 8), (6, False, 1024, 4), (7, True, 1024, 8)):
    rng = np.random.default_rng(seed)
    for step in range(int(sys.argv[1])):
        inputs = random_choice(rng, ties=ties)
        chosen, taken = reference.select_rule(inputs)
        apart, fused = slot_map(inputs), slot_map(inputs)
        expected = reference.place(apart.positions, chosen, taken, inputs.seen)
        got = choose_and_place(
            dataclasses.replace(inputs, positions=fused.positions),
            block=block,
            digit_bits=digit_bits,
        )
        same = [torch.equal(a, b) for a, b in zip(got, expected)]
        same.append(torch.equal(fused.positions, apart.positions))
        if not all(same):
            report["mismatches"].append([seed, step, same])
        report["steps"] += 1
        report["fetched"] += int(expected.fetch.sum())

# A generation: the kernel (as on CUDA) against the PyTorch path, both reading host rows on the
# device's path (mapped), at a reached budget with a history share.
# (with the module's own launch settings)
model = tiny_llama()
ids, mask = padded_batch(lengths=(70, 41))
config = AlisaConfig(
    policy="swa", caching_ratio=0.2, min_budget_tokens=12, retention="host", host_bits=16,
    history_share=0.5,
)
outputs, fetched = [], []
for kernel in (True, False):
    # The reference with the device-read fetch, and with Triton placing the choice (as on CUDA).
    keeper = partial(default_keeper, ops=forced_ops(mapped=True, placing=kernel))
    cache = AlisaCache(model, config, keeper=keeper)
    outputs.append(hf_generate(model, ids, mask, cache, max_new_tokens=6).tolist())
    fetched.append(sum(layer.keeper.fetched for layer in cache.layers))
    report["placing"] = report.get("placing", []) + [cache.layers[0].keeper.ops.placing]
report["same_tokens"] = outputs[0] == outputs[1]
report["generation_fetched"] = fetched
print(json.dumps(report))
"""


def test_the_kernel_equals_choosing_then_placing_in_the_interpreter():
    """Random steps (ties and distinct values, padding, history shares): the same chosen
    positions, fetch flags, target slots and slot map as choosing then placing by PyTorch ops;
    a generation through the kernel: the same tokens and fetches."""
    tests = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(tests))
    done = subprocess.run(
        [sys.executable, "-c", INTERPRETED, "7"],
        cwd=tests.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["steps"] == 21 and report["mismatches"] == []
    assert report["fetched"] > 200  # the steps do move tokens
    assert report["placing"] == [True, False]  # the kernel ran in the first generation only
    assert report["same_tokens"]
    first, second = report["generation_fetched"]
    assert first == second > 0


def test_a_placement_it_cannot_make_is_refused():
    """Before any launch: a slot map not laid out contiguously, positions past what the
    history keys hold."""
    inputs = random_choice(np.random.default_rng(0), ties=False)
    strided = inputs.positions[..., ::2]  # every other slot: not contiguous
    with pytest.raises(ValueError, match="contiguous slot map"):
        choose_and_place(dataclasses.replace(inputs, positions=strided))
    with pytest.raises(ValueError, match=r"2\*\*29 positions; seen=536870912"):
        # (recent windows covering every position the logits do not: ChoiceInputs' own check)
        recent = np.full_like(inputs.recent, (1 << 29) - inputs.logits.shape[-1])
        choose_and_place(dataclasses.replace(inputs, seen=1 << 29, recent=recent))
