"""A new user's bad input, one row each: exit code, no traceback, the value named, no data lost.

Every row runs ``alisa.cli.main`` in-process on the tiny random models of ``conftest`` (saved to
a directory, as a user's model would be). For rows that bring files, the bytes of every file
that existed before the command are compared afterwards.
"""

from __future__ import annotations

import io
import json
import shlex
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import pytest
from conftest import byte_tokenizer, tiny_llama

from alisa import AlisaConfig
from alisa.cli import build_parser, main
from alisa.commands.options import (
    EXIT_ERROR,
    EXIT_ROWS_FAILED,
    EXIT_USAGE,
    field_docs,
    flag_name,
)
from scheduler import preset

REPO = Path(__file__).parents[1]
OK, ERR, USAGE, FAILED = 0, EXIT_ERROR, EXIT_USAGE, EXIT_ROWS_FAILED
ONE = b'{"id": "a", "prompt": "Hi"}\n'
ROW = b'{"id": "a", "text": "x", "tokens": 1, "finish_reason": "stop"}\n'
LONG = "word " * 40  # 200 byte tokens: longer than the short model's 64-token context


@dataclass(frozen=True)
class Case:
    """One command line: ``{tmp}``, ``{model}``, ``{short}``, ``{repo}`` are filled in."""

    argv: str
    code: int
    needles: tuple[str, ...] = ()
    files: dict = field(default_factory=dict)  # name -> bytes written before the run
    stdin: bytes | None = None
    changes: tuple[str, ...] = ()  # pre-existing files the command may rewrite
    absent: tuple[str, ...] = ()  # paths that must not exist afterwards
    unsaid: tuple[str, ...] = ()  # words that must not be in anything the command printed


CASES = {
    # alisa generate
    "stdin-invalid-utf8": Case(
        "generate --model {model} --max-new-tokens 4",
        ERR,
        ("not valid UTF-8",),
        stdin=b"\xff\xfe\x80x",
    ),
    "prompt-empty": Case("generate '   ' --model {model}", ERR, ("prompt is empty",)),
    "prompt-and-file": Case(
        "generate hi --prompt-file {tmp}/p.txt", ERR, ("not both",), files={"p.txt": b"hi"}
    ),
    "prompt-file-binary": Case(
        "generate --prompt-file {tmp}/binary.txt", ERR, ("binary.txt",), {"binary.txt": b"\xff\x80"}
    ),
    "prompt-file-missing": Case("generate --prompt-file {tmp}/none.txt", ERR, ("none.txt",)),
    "max-new-tokens-negative": Case(
        "generate hi --max-new-tokens -3", ERR, ("--max-new-tokens=-3",)
    ),
    "max-new-tokens-text": Case(
        "generate hi --max-new-tokens many", USAGE, ("--max-new-tokens", "many")
    ),
    "dtype-unknown": Case("generate hi --dtype float64", ERR, ("--dtype", "float64")),
    "model-missing": Case("generate hi --model no/such/model/here", ERR, ("no/such/model/here",)),
    "policy-unknown": Case("generate hi --policy magic", ERR, ("--policy", "'magic'", "swa")),
    "caching-ratio-range": Case("generate hi --caching-ratio 1.5", ERR, ("--caching-ratio", "1.5")),
    "caching-ratio-text": Case(
        "generate hi --caching-ratio abc", USAGE, ("--caching-ratio", "abc")
    ),
    "budget-tokens-zero": Case("generate hi --budget-tokens 0", ERR, ("--budget-tokens", "=0")),
    "sink-tokens-negative": Case("generate hi --sink-tokens -1", ERR, ("--sink-tokens", "-1")),
    "kv-bits-3": Case("generate hi --kv-bits 3", ERR, ("--kv-bits", "3")),
    "gpu-memory-text": Case("generate hi --gpu-memory lots", ERR, ("--gpu-memory", "'lots'")),
    "retention-unknown": Case(
        "generate hi --retention disk", ERR, ("--retention", "retention='disk'", "drop, host")
    ),
    "host-bits-3": Case("generate hi --retention host --host-bits 3", ERR, ("--host-bits", "3")),
    "preset-unknown": Case(
        "generate hi --preset papers", ERR, ("--preset", "preset='papers'", "default, paper")
    ),
    "observation-window-negative": Case(
        "generate hi --observation-window -1", ERR, ("--observation-window", "-1")
    ),
    "profile-missing": Case(
        "generate hi --profile {tmp}/missing.json", ERR, ("--profile", "missing.json")
    ),
    "parallel-unknown": Case("generate hi --parallel bogus", ERR, ("--parallel", "bogus", "none")),
    "partition-table-without-file": Case(
        "generate hi --parallel kvr --partition table", ERR, ("--partition", "table")
    ),
    "temperature-zero": Case("generate hi --do-sample --temperature 0", ERR, ("--temperature",)),
    "top-p-above-one": Case("generate hi --do-sample --top-p 2", ERR, ("--top-p", "2")),
    "unknown-flag": Case("generate hi --caching-ration 0.5", USAGE, ("--caching-ration",)),
    "prompt-past-context": Case(
        f"generate '{LONG}' --model {{short}} --max-new-tokens 2",
        ERR,
        ("200 tokens", "context of 64", "max_position_embeddings", "--truncate-prompt"),
    ),
    "prompt-past-context-truncated": Case(
        f"generate '{LONG}' --model {{short}} --max-new-tokens 2 --truncate-prompt", OK
    ),
    "generate-clean": Case("generate hi --model {model} --max-new-tokens 2", OK),
    "new-tokens-past-context": Case(
        "generate hi --model {short} --max-new-tokens 63",
        ERR,
        ("2 tokens", "max_new_tokens=63", "65", "context of 64", "--max-new-tokens"),
    ),
    "max-new-tokens-past-context-alone": Case(
        "generate hi --max-new-tokens 1000000000",
        ERR,
        ("--max-new-tokens=1000000000", "context of 2048"),
    ),
    "new-tokens-past-context-truncated": Case(
        f"generate '{LONG}' --model {{short}} --max-new-tokens 40 --truncate-prompt",
        OK,
        ("last 24 tokens",),
    ),
    "gguf-truncated": Case(
        "generate hi --model {tmp}/t.gguf",
        ERR,
        ("t.gguf", "cannot read the GGUF file"),
        {"t.gguf": b"GGUF\x03\x00\x00\x00\x01\x00"},
    ),
    "dense-with-caching-ratio": Case(
        "generate hi --policy dense --caching-ratio 0.2",
        ERR,
        ("--caching-ratio", "caching_ratio=0.2", "policy='dense'"),
    ),
    "dense-with-budget-tokens": Case(
        "generate hi --budget-tokens 9", ERR, ("--budget-tokens", "budget_tokens=9", "'dense'")
    ),
    "dense-layers-past-the-model": Case(
        "generate hi --policy swa --caching-ratio 0.5 --dense-layers 1000 --max-new-tokens 2",
        ERR,
        ("--dense-layers", "dense_layers=1000", "2 layers"),
    ),
    "parallel-decode-without-parallel": Case(
        "generate hi --parallel-decode sharded", ERR, ("--parallel-decode='sharded'", "--parallel")
    ),
    "partition-without-parallel": Case(
        "generate hi --partition search", ERR, ("--partition='search'", "--parallel")
    ),
    "sampling-flags-without-do-sample": Case(
        "generate hi --temperature 0.7 --seed 3 --max-new-tokens 2",
        OK,
        ("--temperature, --seed", "ignored without --do-sample"),
    ),
    "temperature-infinite": Case(
        "generate hi --do-sample --temperature inf", ERR, ("--temperature", "temperature=inf")
    ),
    "temperature-nan": Case(
        "generate hi --do-sample --temperature nan", ERR, ("--temperature", "temperature=nan")
    ),
    "gpu-memory-zero": Case("generate hi --gpu-memory 0", ERR, ("--gpu-memory", "'0'", "> 0")),
    "gpu-memory-below-weights": Case(
        "generate hi --gpu-memory 1B --max-new-tokens 2",
        ERR,
        ("--gpu-memory", "gpu_memory='1B'", "cannot hold the weights"),
        unsaid=("device_bytes",),
    ),
    "host-memory-without-host-kv": Case(
        "generate hi --host-memory 1KiB --max-new-tokens 2",
        ERR,
        ("--host-memory", "host_memory='1KiB'", "no effect", "retention='host'"),
    ),
    "host-memory-below-host-region": Case(
        f"generate '{LONG}' --policy swa --caching-ratio 0.5 --retention host "
        "--host-memory 1KiB --max-new-tokens 2",
        ERR,
        ("--host-memory", "host_memory='1KiB'", "1024 bytes", "200 prompt tokens"),
    ),
    "host-memory-below-host-tier": Case(
        f"generate '{LONG}' --gpu-memory 650KB --host-memory 1KiB --max-new-tokens 8",
        ERR,
        ("--host-memory", "host_memory='1KiB'", "too small"),
        unsaid=("host_bytes",),
    ),
    "floor-keeps-every-token": Case(
        "generate hi --policy swa --caching-ratio 0.2 --max-new-tokens 2",
        OK,
        ("--min-budget-tokens", "min_budget_tokens=64", "evicts nothing", "lower it"),
    ),
    "floor-below-the-tokens": Case(
        "generate hi --policy swa --caching-ratio 0.2 --max-new-tokens 2 --min-budget-tokens 0",
        OK,
        unsaid=("evicts nothing",),
    ),
    "model-dir-without-config": Case(
        "generate hi --model {tmp}/empty",
        ERR,
        ("empty", "holds no model", "no config.json"),
        {"empty/README.md": b"notes"},
        unsaid=("tokenizer",),
    ),
    "model-inline-attention": Case(
        "generate hi --model {falcon} --max-new-tokens 2",
        ERR,
        ("FalconForCausalLM", "is not supported", "computes attention inline"),
        unsaid=("scaled_dot_product", "sdpa"),
    ),
    "profile-partial": Case(
        "generate hi --profile {tmp}/p.json",
        ERR,
        ("--profile", "p.json", "lacks", "device_bytes, host_bytes"),
        {"p.json": b'{"name": "mine", "overlap": true}'},
        unsaid=("__init__",),
    ),
    # the second tour (issue 30): values torch would reject late, conflicts, flags for nothing
    "max-new-tokens-zero": Case(
        "generate hi --max-new-tokens 0", ERR, ("--max-new-tokens=0", ">= 1")
    ),
    "seed-past-64-bits": Case(
        "generate hi --do-sample --seed 99999999999999999999 --max-new-tokens 2",
        ERR,
        ("--seed", "seed=99999999999999999999", "[0, 2**64)"),
        unsaid=("Overflow",),
    ),
    "seed-negative": Case("generate hi --do-sample --seed -1", ERR, ("--seed", "seed=-1")),
    "budget-tokens-and-caching-ratio": Case(
        "generate hi --policy swa --caching-ratio 0.2 --budget-tokens 10",
        ERR,
        ("--budget-tokens", "budget_tokens=10", "caching_ratio=0.2", "one of the two"),
    ),
    "prompt-file-with-bom": Case(
        "generate --prompt-file {tmp}/p.txt --max-new-tokens 2",
        OK,
        ("prompt 2 tok",),  # the byte tokenizer: a BOM would be 3 more tokens
        {"p.txt": b"\xef\xbb\xbfHi"},
    ),
    "profile-is-a-directory": Case(
        "generate hi --profile {tmp}/d", ERR, ("--profile", "is a directory"), {"d/p.json": b"{}"}
    ),
    "profile-flag-not-a-bool": Case(
        "generate hi --profile {tmp}/p.json",
        ERR,
        ("--profile", "overlap='yes'", "true or false"),
        {"p.json": json.dumps({**asdict(preset("v100-32gb")), "overlap": "yes"}).encode()},
    ),
    "residual-tokens-without-kv-bits": Case(
        "generate hi --residual-tokens 5 --max-new-tokens 2",
        OK,
        ("--residual-tokens", "residual_tokens=5 has no effect", "kv_bits=16"),
    ),
    "host-bits-without-host-retention": Case(
        "generate hi --host-bits 4 --max-new-tokens 2",
        OK,
        ("--host-bits", "host_bits=4 has no effect", "retention='drop'"),
    ),
    # a flag typed at its default value asked for something too (fifth tour, S2)
    "host-bits-typed-at-its-default-without-host-retention": Case(
        "generate hi --host-bits 8 --max-new-tokens 2",
        OK,
        ("--host-bits", "host_bits=8 has no effect", "retention='drop'"),
    ),
    "residual-tokens-typed-at-its-default-without-kv-bits": Case(
        "generate hi --residual-tokens 64 --max-new-tokens 2",
        OK,
        ("--residual-tokens", "residual_tokens=64 has no effect", "kv_bits=16"),
    ),
    "recompute-without-gpu-memory": Case(
        "generate hi --recompute always --max-new-tokens 2",
        OK,
        ("--recompute", "recompute='always' has no effect", "without gpu_memory"),
    ),
    "option-of-another-policy": Case(
        "generate hi --policy swa --caching-ratio 0.5 --stride 4 --max-new-tokens 2",
        OK,
        ("--stride", "stride=4 has no effect", "policy='swa'"),
    ),
    "attention-option-of-an-unscored-policy": Case(
        "generate hi --policy streaming --caching-ratio 0.5 --observation-window 5 "
        "--max-new-tokens 2",
        OK,
        ("--observation-window", "observation_window=5 has no effect", "attention"),
    ),
    "eviction-options-with-dense": Case(
        "generate hi --layer-schedule pyramid --sink-tokens 2 --max-new-tokens 2",
        OK,
        ("--layer-schedule", "--sink-tokens", "policy='dense', which keeps every token"),
    ),
    "settings-all-read": Case(
        "generate hi --policy strided --caching-ratio 0.5 --stride 4 --kv-bits 8 "
        "--residual-tokens 4 --max-new-tokens 2",
        OK,
        unsaid=("no effect",),
    ),
    # alisa batch: output files that are not ours are never cut
    "output-is-notes": Case(
        "batch {tmp}/in.jsonl -o {tmp}/notes.txt --model {model}",
        ERR,
        ("notes.txt:1",),
        {"in.jsonl": ONE, "notes.txt": b"line one\nimportant last line"},
    ),
    "output-is-input": Case(
        "batch {tmp}/s.jsonl -o {tmp}/./s.jsonl --model {model}",
        ERR,
        ("s.jsonl", "input file"),
        {"s.jsonl": b'{"id":1,"prompt":"Hi"}\n{"id":2,"prompt":"Hello"}'},
    ),
    "output-rows-not-objects": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model}",
        ERR,
        ("o.jsonl:1", "not a results row"),
        {"in.jsonl": ONE, "o.jsonl": b"[1]\n"},
    ),
    "output-is-a-copy-of-input": Case(
        "batch {tmp}/in.jsonl -o {tmp}/copy.jsonl --model {model}",
        ERR,
        ("copy.jsonl:1", "finish_reason"),
        {"in.jsonl": ONE, "copy.jsonl": ONE.rstrip()},
    ),
    "output-foreign-last-line": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model}",
        ERR,
        ("o.jsonl:2",),
        {"in.jsonl": ONE, "o.jsonl": ROW + b"important"},
    ),
    "output-invalid-utf8": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model}",
        ERR,
        ("o.jsonl:1",),
        {"in.jsonl": ONE, "o.jsonl": b"\xff\xfe\n"},
    ),
    "output-our-torn-row": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model} --max-new-tokens 2 --no-progress",
        OK,
        (),
        {"in.jsonl": ONE + b'{"id": "b", "prompt": "Yo"}\n', "o.jsonl": ROW + b'{"id": "b", "te'},
        changes=("o.jsonl",),
    ),
    "output-user-line-starting-like-a-row": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model}",
        ERR,
        ("o.jsonl:1", "unterminated", "nothing was changed"),
        {"in.jsonl": ONE, "o.jsonl": b'{"id": "mine", "note": "keep me"'},
    ),
    "failures-file-not-ours": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model} --max-new-tokens 2 --no-progress",
        ERR,
        ("o.jsonl.failed", "not a failures list"),
        {"in.jsonl": ONE, "o.jsonl.failed": b"my own notes\n"},
        absent=("o.jsonl", "o.jsonl.lock"),
    ),
    "output-is-dev-null": Case(
        "batch {tmp}/in.jsonl -o /dev/null --model {model}",
        ERR,
        ("/dev/null", "not a regular file"),
        {"in.jsonl": ONE},
        unsaid=("Errno",),
    ),
    "output-is-a-directory": Case(
        "batch {tmp}/in.jsonl -o {tmp} --model {model}",
        ERR,
        ("cannot write output",),
        {"in.jsonl": ONE},
    ),
    # alisa batch: rows checked before the model loads, with file:line and id
    "row-max-new-tokens-negative": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {tmp}/no-model",
        ERR,
        ("in.jsonl:2", "max_new_tokens=-5", "'b'"),
        {"in.jsonl": ONE + b'{"id": "b", "prompt": "x", "max_new_tokens": -5}\n'},
        absent=("o.jsonl",),
    ),
    "row-max-new-tokens-zero": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {tmp}/no-model",
        ERR,
        ("in.jsonl:1", "max_new_tokens=0"),
        {"in.jsonl": b'{"id": "a", "prompt": "x", "max_new_tokens": 0}\n'},
    ),
    "row-temperature-zero": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {tmp}/no-model",
        ERR,
        ("in.jsonl:1", "temperature=0"),
        {"in.jsonl": b'{"id": "a", "prompt": "x", "temperature": 0}\n'},
    ),
    "row-prompt-number": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl",
        ERR,
        ("in.jsonl:1", "must be a string", "42"),
        {"in.jsonl": b'{"id": "a", "prompt": 42}\n'},
    ),
    "row-prompt-missing": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl",
        ERR,
        ("in.jsonl:1", "missing"),
        {"in.jsonl": b'{"id": "a"}\n'},
    ),
    "row-malformed": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl",
        ERR,
        ("in.jsonl:2", "malformed"),
        {"in.jsonl": ONE + b"{x\n"},
    ),
    "row-line-separator-in-a-string": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --max-new-tokens 2 --no-progress",
        OK,
        (),
        {"in.jsonl": '{"id": "a", "prompt": "Hi\u2028there\u2029and\u0085more"}\n'.encode()},
    ),
    "batch-host-memory-without-retention": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --host-memory 1GB",
        ERR,
        ("--host-memory", "1GB", "no effect"),
        {"in.jsonl": ONE},
        absent=("o.jsonl",),
    ),
    "row-not-object": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl",
        ERR,
        ("in.jsonl:1", "object"),
        {"in.jsonl": b"[1]\n"},
    ),
    "input-invalid-utf8": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl", ERR, ("in.jsonl",), {"in.jsonl": b"\xff\xfe\n"}
    ),
    "input-missing": Case("batch {tmp}/missing.jsonl -o {tmp}/o.jsonl", ERR, ("missing.jsonl",)),
    "batch-max-new-tokens-zero": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --max-new-tokens 0",
        ERR,
        ("--max-new-tokens=0",),
        {"in.jsonl": ONE},
    ),
    "batch-rank-timeout-zero": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --rank-timeout 0",
        ERR,
        ("--rank-timeout=0",),
        {"in.jsonl": ONE},
        absent=("o.jsonl",),
    ),
    "input-without-rows": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --max-new-tokens 2 --no-progress",
        OK,
        ("in.jsonl holds no rows", "0 prompts done"),
        {"in.jsonl": b"\n  \n"},
    ),
    "batch-kv-memory-zero": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --kv-memory 0",
        ERR,
        ("--kv-memory='0'", "> 0"),
        {"in.jsonl": ONE},
        absent=("o.jsonl",),
        unsaid=("kv_bytes",),
    ),
    "input-with-bom": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --max-new-tokens 2 --no-progress",
        OK,
        ('"id": "a"', "1 prompts done"),
        {"in.jsonl": b"\xef\xbb\xbf" + ONE},
    ),
    "row-seed-past-64-bits": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {tmp}/no-model",
        ERR,
        ("in.jsonl:2", "seed=18446744073709551616", "[0, 2**64)", "'b'"),
        {"in.jsonl": ONE + b'{"id": "b", "prompt": "x", "seed": 18446744073709551616}\n'},
        absent=("o.jsonl",),
    ),
    "batch-flag-for-nothing": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --host-bits 4 --max-new-tokens 2 --no-progress",
        OK,
        ("--host-bits", "host_bits=4 has no effect"),
        {"in.jsonl": ONE},
    ),
    "batch-kv-memory-text": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --kv-memory lots",
        ERR,
        ("--kv-memory", "lots"),
        {"in.jsonl": ONE},
    ),
    # alisa batch: rows that do not fit fail the job (exit 3) and are retried by a re-run
    "kv-budget-1-byte": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model} --kv-memory 1B --no-progress",
        FAILED,
        ("1 row(s) failed", "did_not_fit", "KV budget --kv-memory 1B", "in.jsonl:1: id 'a'"),
        {"in.jsonl": ONE},
    ),
    "max-new-tokens-huge": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {model} --max-new-tokens 1000000000 "
        "--no-progress",
        ERR,
        ("--max-new-tokens=1000000000", "context of 2048"),
        {"in.jsonl": ONE},
        absent=("o.jsonl.failed", "o.jsonl.lock"),
    ),
    "batch-row-new-tokens-past-context": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {short} --max-new-tokens 2 --no-progress",
        FAILED,
        ("1 row(s) failed", "context_exceeded", "max_new_tokens=63", "context of 64"),
        {"in.jsonl": b'{"id": "a", "prompt": "Hi", "max_new_tokens": 63}\n'},
    ),
    "batch-rank-timeout-nan": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --rank-timeout nan",
        ERR,
        ("--rank-timeout=nan",),
        {"in.jsonl": ONE},
        absent=("o.jsonl",),
    ),
    "batch-rank-timeout-without-torchrun": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --rank-timeout 5 --max-new-tokens 2 --no-progress",
        OK,
        ("--rank-timeout ignored", "torchrun"),
        {"in.jsonl": ONE},
    ),
    "batch-row-sampling-without-do-sample": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --max-new-tokens 2 --no-progress",
        OK,
        ("in.jsonl", "1 row(s) set", "do_sample", "greedily", "line 1"),
        {"in.jsonl": b'{"id": "a", "prompt": "Hi", "temperature": 0.7}\n'},
    ),
    "batch-prompt-past-context": Case(
        "batch {tmp}/in.jsonl -o {tmp}/o.jsonl --model {short} --max-new-tokens 2 --no-progress",
        FAILED,
        ("1 row(s) failed", "prompt_too_long", "context of 64", "in.jsonl:2: id 'long'"),
        {"in.jsonl": ONE + f'{{"id": "long", "prompt": "{LONG}"}}\n'.encode()},
        unsaid=("larger budget", "larger one"),
    ),
    # alisa plan
    "plan-dtype-int3": Case("plan --dtype int3", ERR, ("--dtype", "int3")),
    "plan-gpu-memory-zero": Case(
        "plan --hardware v100-32gb --gpu-memory 0", ERR, ("--gpu-memory", "0")
    ),
    "plan-model-unknown": Case("plan --model nosuch", ERR, ("nosuch", "opt-13b", "smollm2-135m")),
    "plan-hardware-unknown": Case("plan --hardware tpu-v9", ERR, ("tpu-v9", "v100-32gb")),
    "plan-hardware-and-profile": Case(
        "plan --hardware v100-32gb --profile {tmp}/p.json", ERR, ("--profile",)
    ),
    "plan-batch-zero": Case("plan --hardware v100-32gb --batch 0", ERR, ("--batch=0",)),
    "plan-kv-bits-3": Case("plan --hardware v100-32gb --kv-bits 3", ERR, ("--kv-bits", "3")),
    "plan-recent-fraction-gone": Case("plan --recent-fraction 0.5", USAGE, ("--recent-fraction",)),
    "plan-clean": Case("plan --model opt-13b --hardware v100-32gb --batch 4", OK),
    "plan-gpu-memory-past-the-device": Case(
        "plan --model opt-13b --hardware v100-32gb --gpu-memory 100TB --batch 16 --prompt-len 1024",
        OK,
        ("--gpu-memory 100TB", "more than the 32.0 GiB", "device 32.00 GiB"),
    ),
    "plan-prompt-past-context": Case(
        "plan --model opt-13b --hardware v100-32gb --prompt-len 100000",
        ERR,
        ("--prompt-len=100000", "context of 2048"),
    ),
    "plan-new-tokens-past-context": Case(
        "plan --model {short} --prompt-len 60 --gen-len 8",
        ERR,
        ("--gen-len=8", "68 tokens", "context of 64"),
    ),
    "plan-gpu-memory-below-weights": Case(
        "plan --model opt-13b --hardware v100-32gb --gpu-memory 100MB",
        ERR,
        ("--gpu-memory", "gpu_memory='100MB'", "cannot hold"),
        unsaid=("device_bytes",),
    ),
    "plan-weights-streamed-under-a-larger-budget": Case(
        "plan --model smollm2-135m --hardware v100-32gb --gpu-memory 1GB --batch 64 "
        "--prompt-len 4096",
        OK,
        ("all layers on the host", "would fit the 0.93 GiB budget", "gives that room to KV"),
    ),
    "plan-profile-partial": Case(
        "plan --profile {tmp}/p.json",
        ERR,
        ("--profile", "p.json", "lacks", "h2d_bytes_per_s"),
        {"p.json": b'{"name": "mine"}'},
    ),
    "plan-hardware-empty": Case("plan --hardware ''", ERR, ("hardware preset ''", "v100-32gb")),
    "plan-profile-directory": Case(
        "plan --profile {tmp}/d", ERR, ("--profile", "is a directory"), {"d/p.json": b"{}"}
    ),
    # The plan reads --recompute (a preset has a device), unlike generate without --gpu-memory;
    # on a workload the device holds whole it forbids nothing, which the plan says (tour 19).
    "plan-recompute-on-the-whole-device": Case(
        "plan --model opt-13b --hardware v100-32gb --recompute never",
        OK,
        ("--recompute never has no effect on this plan: it would recompute nothing either way",),
        unsaid=("without gpu_memory",),
    ),
    "plan-flag-for-nothing": Case(
        "plan --model opt-13b --hardware v100-32gb --host-bits 4",
        OK,
        ("--host-bits", "host_bits=4 has no effect"),
    ),
    # alisa profile: every check before measuring
    "profile-threads-negative": Case("profile --threads -1 --model none", ERR, ("--threads=-1",)),
    "profile-threads-zero": Case("profile --threads 0 --model none", ERR, ("--threads=0",)),
    "profile-output-directory": Case(
        "profile --model none --output {tmp}", ERR, ("--output", "directory")
    ),
    "profile-output-under-file": Case(
        "profile --model none --output {tmp}/f/p.json",
        ERR,
        ("--output", "not a directory"),
        {"f": b"x"},
    ),
    "profile-output-exists": Case(
        "profile --model none --output {tmp}/p.json",
        ERR,
        ("--output", "p.json", "--force"),
        {"p.json": b"my profile"},
    ),
    "profile-output-unwritable": Case(
        "profile --model none --output /proc/alisa-p.json",
        ERR,
        ("--output", "/proc/alisa-p.json", "cannot be written"),
    ),
    "profile-output-folder-missing": Case(
        "profile --model none --output {tmp}/typo/p.json",
        ERR,
        ("--output", "its folder", "typo", "does not exist"),
        absent=("typo",),
    ),
    "profile-context-below-the-floor": Case(
        "profile --model {model} --context 16 --output {tmp}/p.json",
        ERR,
        ("--context=16", "must be >= 130"),
    ),
    "profile-batch-without-a-model": Case(
        "profile --model none --batch 4 --output {tmp}/p.json",
        ERR,
        ("--batch=4", "no effect with --model none"),
    ),
    "profile-dtype-unknown": Case(
        "profile --model none --dtype int8 --output {tmp}/p.json", ERR, ("--dtype", "'int8'")
    ),
    # alisa experiment
    "experiment-threads-zero": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set runtime.threads=0",
        ERR,
        ("runtime.threads=0",),
    ),
    "experiment-threads-text": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set runtime.threads=abc",
        ERR,
        ("runtime.threads='abc'",),
    ),
    "experiment-dtype-unknown": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set runtime.dtype=int3",
        ERR,
        ("runtime.dtype='int3'",),
    ),
    "experiment-set-without-value": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set threads",
        ERR,
        ("'threads'", "key=value"),
    ),
    "experiment-option-typo": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml "
        "--set options.perplexity.segment_tokns=64",
        ERR,
        ("options.perplexity.segment_tokns", "segment_tokens"),
    ),
    "experiment-segment-tokens-negative": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml "
        "--set options.perplexity.segment_tokens=-5",
        ERR,
        ("options.perplexity.segment_tokens=-5",),
    ),
    "experiment-batch-zero": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set sweep.batch=0",
        ERR,
        ("sweep.batch=0",),
    ),
    "experiment-name-outside-results": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set name=.. "
        "--set runtime.results_dir='{tmp}/results'",
        ERR,
        ("name='..'",),
        absent=("results",),
    ),
    "experiment-config-missing": Case("experiment --config {tmp}/none.toml", ERR, ("none.toml",)),
    "experiment-data-dir-missing": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --data-dir {tmp}/no-data "
        "--set runtime.results_dir='{tmp}/results' --no-progress",
        ERR,
        ("--data-dir", "no-data"),
        absent=("results",),
    ),
    "experiment-model-fails-leaves-no-run": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --data-dir {tmp} "
        "--set sweep.model='{tmp}/no-model' --set runtime.results_dir='{tmp}/results' "
        "--no-progress",
        ERR,
        ("no-model",),
        absent=("results/smoke",),
    ),
    "experiment-options-of-an-unswept-task": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set options.xsum.limit=5 "
        "--data-dir {tmp}/no-data --set runtime.results_dir='{tmp}/results'",
        ERR,
        ("options.xsum has no effect", "not in sweep.task (perplexity, copa)", "--data-dir"),
        absent=("results",),
    ),
    "experiment-sweep-value-out-of-range": Case(
        "experiment --config {repo}/experiments/configs/smoke.toml --set sweep.caching_ratio=2 "
        "--set runtime.results_dir='{tmp}/results'",
        ERR,
        ("smoke.toml", "sweep point", "'caching_ratio': 2", "caching_ratio=2", "(0, 1]"),
        absent=("results",),
    ),
    "experiment-config-with-bom": Case(
        "experiment --config {tmp}/c.toml --set runtime.results_dir='{tmp}/results'",
        ERR,
        ("unknown task 'nosuch'",),  # read past the BOM: the file's own content is judged
        {"c.toml": b'\xef\xbb\xbfname = "x"\n[sweep]\ntask = ["nosuch"]\n'},
        absent=("results",),
    ),
    "experiment-config-not-utf8": Case(
        "experiment --config {tmp}/c.toml",
        ERR,
        ("c.toml", "not UTF-8"),
        {"c.toml": b"name = '\xff'"},
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("models")
    built = (
        ("tiny", tiny_llama()),
        ("short", tiny_llama(max_position_embeddings=64)),
        ("falcon", _tiny_falcon()),  # an architecture alisa refuses
    )
    for name, model in built:
        model.save_pretrained(root / name)
        byte_tokenizer().save_pretrained(root / name)
    return {
        "model": str(root / "tiny"),
        "short": str(root / "short"),
        "falcon": str(root / "falcon"),
    }


def _tiny_falcon():
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0
    )
    return FalconForCausalLM(config).eval()


def run_cli(argv: list[str], capsys, monkeypatch, stdin: bytes | None) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin or b"")))
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, tmp_path, models, capsys, monkeypatch):
    check_case(CASES[name], tmp_path, models, capsys, monkeypatch)


def check_case(case: Case, tmp_path: Path, models: dict, capsys, monkeypatch) -> None:
    """Run one row of a bad-input table and check all it promises (other tables use it too)."""
    for file, data in case.files.items():
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_bytes(data)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    values = {"tmp": str(tmp_path), "repo": str(REPO), **models}
    argv = shlex.split(case.argv.format(**values))
    if "--model" not in argv and argv[0] in ("generate", "batch"):
        argv += ["--model", models["model"]]
    code, out, err = run_cli(argv, capsys, monkeypatch, case.stdin)
    created = [p for p in tmp_path.rglob("*") if p.is_file() and p not in before]
    seen = err + out + "".join(p.read_text(errors="replace") for p in created)
    assert code == case.code, err
    assert "Traceback" not in err
    for needle in case.needles:
        assert needle in seen, f"{needle!r} not in {seen!r}"
    for word in case.unsaid:
        assert word not in err + out, f"{word!r} in {err + out!r}"
    if code != OK:
        assert err.strip(), "a failure must say why"
    for path, data in before.items():
        if path.name not in case.changes:
            assert path.read_bytes() == data, f"{path.name} was modified"
    for relative in case.absent:
        assert not (tmp_path / relative).exists(), f"{relative} was left behind"


def test_rows_that_did_not_fit_are_retried_by_a_rerun(tmp_path, models, capsys, monkeypatch):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(ONE)
    argv = ["batch", str(source), "-o", str(target), "--model", models["model"], "--no-progress"]
    argv += ["--max-new-tokens", "2"]
    failures = tmp_path / "out.jsonl.failed"
    assert run_cli(argv + ["--kv-memory", "1B"], capsys, monkeypatch, None)[0] == FAILED
    assert target.read_text() == ""  # a failed row is not a result: the output holds none
    failed = [json.loads(line) for line in failures.read_text().splitlines()]
    assert [(r["id"], r["finish_reason"]) for r in failed] == [("a", "did_not_fit")]
    assert run_cli(argv, capsys, monkeypatch, None)[0] == OK
    lines = target.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["id"] == "a"  # each id exactly once
    assert json.loads(lines[0])["text"] is not None and "error" not in json.loads(lines[0])
    assert not failures.exists()  # nothing failed this time: the stale list is gone
    assert run_cli(argv, capsys, monkeypatch, None)[0] == OK  # done now: nothing more appended
    assert target.read_text().splitlines() == lines


def test_plan_dtype_applies_to_presets(capsys, monkeypatch):
    argv = ["plan", "--model", "opt-13b", "--hardware", "a100-40gb", "--json", "--dtype"]
    code16, out16, _ = run_cli(argv + ["bfloat16"], capsys, monkeypatch, None)
    code32, out32, _ = run_cli(argv + ["float32"], capsys, monkeypatch, None)
    assert code16 == code32 == OK
    # opt-13b's 26 GB of bf16 weights fit the 40 GB device; in float32 they must spill.
    assert json.loads(out16)["weight_host_fraction"] == 0
    assert json.loads(out32)["weight_host_fraction"] > 0


def test_every_config_field_is_a_documented_flag():
    docs = field_docs(AlisaConfig)
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for item in fields(AlisaConfig):
        assert docs.get(item.name), f"AlisaConfig field {item.name!r} has no docstring entry"
        assert flag_name(item.name) in help_text


def test_every_flag_has_help_text():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    for name, parser in subcommands.items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"alisa {name} {action.option_strings[0]} has no help"


def test_python_api_refuses_the_same_inputs(tmp_path):
    from alisa import BatchJob, generate, run_batch

    model, tokenizer = tiny_llama(max_position_embeddings=64), byte_tokenizer()
    with pytest.raises(ValueError, match="200 tokens, more than the model's context of 64"):
        generate(model, tokenizer, LONG, max_new_tokens=1)
    source = tmp_path / "in.jsonl"
    source.write_bytes(ONE)
    with pytest.raises(ValueError, match="is the input file"):
        run_batch(model, tokenizer, BatchJob(input=str(source), output=str(source)))
    assert source.read_bytes() == ONE
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        BatchJob(input=str(source), output=str(tmp_path / "o.jsonl"), max_new_tokens=0)


def test_a_second_writer_of_one_output_is_refused(tmp_path, models, capsys, monkeypatch):
    from alisa.jobs.lock import output_lock

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(ONE)
    argv = ["batch", str(source), "-o", str(target), "--model", models["model"], "--no-progress"]
    argv += ["--max-new-tokens", "2"]
    with output_lock(target):  # another run, as far as the command can tell
        code, _, err = run_cli(argv, capsys, monkeypatch, None)
    assert code == ERR, err
    assert "another alisa run" in err and str(target) in err and "Traceback" not in err
    assert not target.exists()  # refused before anything was written
    assert run_cli(argv, capsys, monkeypatch, None)[0] == OK  # released: the next run works
    assert len(target.read_text().splitlines()) == 1
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_python_api_takes_the_output_lock(tmp_path):
    from alisa import BatchJob, run_batch
    from alisa.jobs.lock import output_lock

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(ONE)
    job = BatchJob(input=str(source), output=str(target), max_new_tokens=2, progress=False)
    with output_lock(target), pytest.raises(ValueError, match="another alisa run"):
        run_batch(tiny_llama(), byte_tokenizer(), job)
    assert run_batch(tiny_llama(), byte_tokenizer(), job).completed == 1


def test_profile_force_overwrites(tmp_path):
    from alisa.commands.options import check_new_file

    path = tmp_path / "p.json"
    path.write_bytes(b"old")
    check_new_file("--output", path, force=True)  # allowed, and the file is not touched
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: AlisaConfig(policy=None), "policy=None"),
        (lambda: AlisaConfig(caching_ratio="0.5"), "caching_ratio='0.5'"),
        (lambda: AlisaConfig(dense_layers=None), "dense_layers=None"),
        (lambda: AlisaConfig(gpu_memory=float("inf")), "gpu_memory=inf"),
        (lambda: _sampling(do_sample="no"), "do_sample='no' must be a bool"),
        (lambda: _sampling(do_sample=None), "do_sample=None"),
        (lambda: _sampling(seed="x"), "seed='x'"),
        (lambda: _sampling(top_k=2.5), "top_k=2.5"),
        (lambda: _sampling(temperature=float("inf")), "temperature=inf"),
        (lambda: _sampling(temperature="1"), "temperature='1'"),
        (lambda: _job(input=None), "input=None"),
        (lambda: _job(output=3), "output=3"),
        (lambda: _job(config=None), "config=None"),
        (lambda: _job(config="swa"), "config='swa'"),
        (lambda: _job(stop_at_eos="no"), "stop_at_eos='no'"),
        (lambda: _job(kv_memory=float("inf")), "kv_memory=inf"),
        (lambda: _job(kv_memory=float("nan")), "kv_memory=nan"),
        (lambda: _job(kv_memory=0), "kv_memory=0 must be a byte size > 0"),
        (lambda: _job(gpu_memory="0.1B"), "gpu_memory='0.1B' must be a byte size > 0"),
        (lambda: _sampling(seed=-1), "seed=-1 must be an integer in [0, 2**64)"),
        (lambda: _sampling(seed=2**64), f"seed={2**64}"),
        (
            lambda: AlisaConfig(policy="swa", caching_ratio=0.2, budget_tokens=10),
            "budget_tokens=10 replaces caching_ratio=0.2",
        ),
        (lambda: _load(None), "model=None must name a model"),
        (lambda: _load(3), "model=3 must name a model"),
        (lambda: _load(""), "model='' must name a model"),
        (lambda: _load("smollm2-135m", device="tpu"), "device='tpu' is not a torch device"),
        (lambda: _threads("4"), "threads='4' must be an integer >= 1"),
        (lambda: _threads(2.5), "threads=2.5 must be an integer >= 1"),
    ],
)
def test_python_api_names_the_field_of_a_bad_argument(build, needle):
    with pytest.raises(ValueError) as error:
        build()
    assert needle in str(error.value)


def _load(spec, **options):
    from alisa import load_model

    return load_model(spec, **options)


def _threads(requested):
    from alisa import use_threads

    return use_threads(requested)


def _sampling(**values):
    from alisa.runtime.generate import SamplingOptions

    return SamplingOptions(**values)


def _job(**values):
    from alisa import BatchJob

    return BatchJob(**{"input": "in.jsonl", "output": "out.jsonl", **values})


def test_python_api_refuses_new_tokens_past_the_context():
    from alisa import AlisaCache, generate

    model, tokenizer = tiny_llama(max_position_embeddings=64), byte_tokenizer()
    with pytest.raises(ValueError, match="2 tokens and max_new_tokens=63 .* context of 64"):
        generate(model, tokenizer, "Hi", max_new_tokens=63)
    assert len(generate(model, tokenizer, "Hi", max_new_tokens=62).token_ids[0]) <= 62
    with pytest.raises(ValueError, match="dense_layers=3 .* the model's 2 layers"):
        AlisaCache(model, AlisaConfig(policy="swa", caching_ratio=0.5, dense_layers=3))


def test_version_comes_from_the_package(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"alisa {version('alisa')}"


def test_a_relative_directory_without_a_model_is_not_a_hub_id(tmp_path, capsys, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # "models/mine" reads like owner/name
    code, _, err = run_cli(["generate", "hi", "--model", "models/mine"], capsys, monkeypatch, None)
    assert code == ERR and "'models/mine' holds no model (no config.json)" in err
    assert "tokenizer" not in err


def test_profile_default_output_is_checked_before_measuring(capsys, monkeypatch):
    monkeypatch.setenv("ALISA_CACHE_DIR", "/proc/alisa-none")  # nowhere anyone can write
    code, _, err = run_cli(["profile", "--model", "none"], capsys, monkeypatch, None)
    assert code == ERR and "/proc/alisa-none/profile-" in err and "cannot be written" in err


def test_a_failed_write_names_the_output(tmp_path, monkeypatch):
    import errno

    from alisa.jobs import io as job_io

    log = job_io.OutputLog(tmp_path / "o.jsonl")

    def full(descriptor, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(job_io.os, "write", full)
    with pytest.raises(ValueError, match=r"o\.jsonl'?: No space left on device; the complete rows"):
        log.append({"id": "a"})
    log.close()


def test_plan_keeps_the_budget_floor(capsys, monkeypatch):
    argv = ["plan", "--model", "opt-13b", "--hardware", "v100-32gb", "--json", "--policy", "swa"]
    argv += ["--caching-ratio", "0.01", "--prompt-len", "512"]
    for flags, floor in (([], 64), (["--min-budget-tokens", "300"], 300)):
        code, out, _ = run_cli(argv + flags, capsys, monkeypatch, None)
        assert code == OK
        assert min(bucket["kept_tokens"] for bucket in json.loads(out)["buckets"]) == floor


def test_perplexity_says_when_the_floor_evicts_nothing(capsys):
    import torch

    from experiments.tasks.perplexity import decode_perplexity

    segments = torch.arange(2, 18).view(1, 16)
    config = AlisaConfig(policy="swa", caching_ratio=0.5)
    decode_perplexity(tiny_llama(), segments, config, progress=False)
    err = capsys.readouterr().err
    assert "min_budget_tokens=64 (the default preset's floor) keeps all 16 tokens" in err
    assert len(err.strip().splitlines()) == 1
    decode_perplexity(tiny_llama(), segments, config.with_overrides(min_budget_tokens=4))
    assert "evicts nothing" not in capsys.readouterr().err


def test_host_memory_is_a_limit_of_retention_host():
    from alisa import generate

    model, tokenizer = tiny_llama(), byte_tokenizer()
    config = AlisaConfig(policy="swa", caching_ratio=0.5, retention="host")
    result = generate(model, tokenizer, LONG, config, max_new_tokens=8)
    held = result.kv_tier_bytes["host"]
    # The check's bound is what the host region grows to: exactly enough passes, a byte less not.
    generate(model, tokenizer, LONG, config.with_overrides(host_memory=held), max_new_tokens=8)
    with pytest.raises(ValueError, match=f"host_memory={held - 1} .* need up to {held} bytes"):
        generate(
            model, tokenizer, LONG, config.with_overrides(host_memory=held - 1), max_new_tokens=8
        )


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda m, t: _generate(m, t, None), "prompts=None must be a string or a list"),
        (lambda m, t: _generate(m, t, b"hi"), "prompts=b'hi' must be a string or a list"),
        (lambda m, t: _generate(m, t, "hi", "swa"), "config='swa' must be an AlisaConfig"),
        (lambda m, t: _generate(m, t, "hi", {"policy": "swa"}), "config={'policy': 'swa'}"),
        (lambda m, t: _generate(m, t, "hi", sampling={}), "sampling={} must be a SamplingOptions"),
        (lambda m, t: _generate(m, t, "hi", chat="yes"), "chat='yes' must be True or False"),
        (lambda m, t: _generate(m, t, "hi", chat=True), "no chat template"),
        (lambda m, t: _generate(None, t, "hi"), "model=None must be a torch model"),
        (lambda m, t: _generate(m, None, "hi"), "tokenizer=None must be an HF tokenizer"),
        (lambda m, t: _cache(m, "swa"), "config='swa' must be an AlisaConfig"),
        (lambda m, t: _stream(m, t, config="swa"), "config='swa' must be an AlisaConfig"),
        (lambda m, t: _stream(m, t, kv_memory=0), "kv_memory=0 must be a byte size > 0"),
        (lambda m, t: _stream(m, t, sampling={}), "sampling={} must be a SamplingOptions"),
    ],
)
def test_python_api_names_a_wrongly_typed_argument(call, needle):
    with pytest.raises(ValueError) as error:
        call(tiny_llama(), byte_tokenizer())
    assert needle in str(error.value)


def _generate(model, tokenizer, prompts, config=None, **options):
    from alisa import generate

    return generate(model, tokenizer, prompts, config, max_new_tokens=2, **options)


def _cache(model, config):
    from alisa import AlisaCache

    return AlisaCache(model, config)


def _stream(model, tokenizer, **options):
    from alisa.jobs.stream import stream_generate

    return list(stream_generate(model, tokenizer, ["hi"], max_new_tokens=2, **options))


def test_cuda_that_torch_lacks_is_named_before_loading(monkeypatch):
    import torch

    from alisa import load_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda': CUDA is not available to torch"):
        load_model("no/such-model-is-read", device="cuda")


def test_stream_generate_never_runs_a_row_past_the_context():
    from alisa.jobs.stream import stream_generate

    model, tokenizer = tiny_llama(max_position_embeddings=64), byte_tokenizer()
    prompts = ["Hi", LONG, "Yo"]
    stream = stream_generate(model, tokenizer, prompts, max_new_tokens=40, stop_at_eos=False)
    results = {r.id: r for r in stream}
    assert results[1].finish_reason == "prompt_too_long" and results[1].token_ids == []
    assert "200 tokens, more than the model's context of 64" in results[1].error
    assert [results[i].finish_reason for i in (0, 2)] == ["length", "length"]
    assert all(len(results[i].token_ids) == 40 for i in (0, 2))
    past = list(stream_generate(model, tokenizer, ["Hi"], max_new_tokens=63))
    assert past[0].finish_reason == "context_exceeded" and past[0].token_ids == []
    assert "max_new_tokens=63" in past[0].error and "context of 64" in past[0].error


def test_generate_chat_sends_each_prompt_in_the_template():
    from alisa import generate

    model, tokenizer = tiny_llama(), byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}:"
    chat = generate(model, tokenizer, ["hi", "yo"], max_new_tokens=3, chat=True)
    plain = generate(model, tokenizer, ["<hi>:", "<yo>:"], max_new_tokens=3)
    assert chat.prompt_tokens == plain.prompt_tokens == [5, 5]
    assert chat.token_ids == plain.token_ids
