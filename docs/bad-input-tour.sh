#!/usr/bin/env bash
# The bad-input tour of issue 30, re-run: every example of the issue as a user would type it.
# Prints one markdown row per case: id | exit code | what alisa said (the first error/warning line,
# else the last line; "TRACEBACK" if one was printed). docs/bad-input-tour.md holds the table.
#
#   bash docs/bad-input-tour.sh > /tmp/tour.md        # from the repository root, after make setup
#
# Uses the built-in SmolLM2 (context 8192) and tiny random models built from the test helpers
# (Falcon, Phi, a Llama with a 64-token context) under a temporary directory.
set -u
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH=tests
BIN=.venv/bin
T=$(mktemp -d /tmp/alisa-tour.XXXXXX)
mkdir -p "$T/log"

$BIN/python - "$T" <<'EOF'
import sys
from pathlib import Path

from conftest import byte_tokenizer, tiny_llama
from experiments.architectures import build_tiny, tiny_config

root = Path(sys.argv[1])
for name, model in (("falcon", build_tiny(tiny_config("falcon"))),
                    ("phi", build_tiny(tiny_config("phi"))),
                    ("short", tiny_llama(max_position_embeddings=64))):
    model.save_pretrained(root / name)
    byte_tokenizer().save_pretrained(root / name)
EOF

gguf=$($BIN/python -c "from alisa.model.builtin import locate_builtin_gguf as f; from alisa.model.loading import cache_root; print(f('smollm2-135m', cache_root()))")
head -c 200000 "$gguf" > "$T/truncated.gguf"
printf '{"id": "a", "prompt": "Hi"}\n{"id": "b", "prompt": "Yo"}\n' > "$T/in.jsonl"
mkdir -p "$T/empty"

row() {  # row ID COMMAND...: run it, print "| ID | rc | said |"
    local id=$1; shift
    timeout 600 "$@" > "$T/log/$id.txt" 2>&1 < /dev/null
    local rc=$?
    local said
    if grep -q Traceback "$T/log/$id.txt"; then
        said="TRACEBACK: $(grep -v '^ ' "$T/log/$id.txt" | tail -1)"
    else
        # the error, else a warning (not the busy machine's thread warning), else the last line
        said=$(grep -m1 -E "error:|Error" "$T/log/$id.txt" \
            || grep -v oversubscribed "$T/log/$id.txt" | grep -m1 "warning:" \
            || tail -1 "$T/log/$id.txt")
    fi
    said=${said//|/\\|}
    echo "| $id | $rc | ${said:0:300} |"
}

A="$BIN/alisa"
echo "| case | exit | what alisa says |"
echo "|---|---|---|"
# --- data loss
printf '{"id": "mine", "note": "my own notes, no newline' > "$T/user.jsonl"
cp "$T/user.jsonl" "$T/user.before"
row user-file-as-output $A batch "$T/in.jsonl" -o "$T/user.jsonl" --max-new-tokens 2 --no-progress
cmp -s "$T/user.jsonl" "$T/user.before" && echo "| (user-file-as-output: file unchanged) | | |"
printf 'my notes\n' > "$T/o1.jsonl.failed"
row foreign-failed-file $A batch "$T/in.jsonl" -o "$T/o1.jsonl" --max-new-tokens 2 --no-progress
grep -q "my notes" "$T/o1.jsonl.failed" && echo "| (foreign-failed-file: kept) | | |"
echo '{"mine": 1}' > "$T/existing.json"
row profile-output-existing $A profile --model none --output "$T/existing.json"
grep -q mine "$T/existing.json" && echo "| (profile-output-existing: kept) | | |"
# --- silent wrong results
for i in $(seq 1 6); do echo "{\"id\": \"r$i\", \"prompt\": \"Count to $i\"}"; done > "$T/six.jsonl"
$A batch "$T/six.jsonl" -o "$T/two.jsonl" --max-new-tokens 32 --no-progress > "$T/log/first.txt" 2>&1 &
for _ in $(seq 1 300); do [ -e "$T/two.jsonl" ] && break; sleep 0.1; done  # it holds the output (a lock on the file itself)
row second-concurrent-batch $A batch "$T/six.jsonl" -o "$T/two.jsonl" --max-new-tokens 32 --no-progress
wait
echo "| (concurrent: ids in the output) | | $(cut -d'"' -f4 "$T/two.jsonl" | sort | uniq -c | tr '\n' ' ') |"
row new-tokens-past-context $A generate "Hi" --max-new-tokens 8192
row max-new-tokens-1e9 $A generate "Hi" --max-new-tokens 1000000000
echo '{"id": "a", "prompt": "Hi", "max_new_tokens": 8192}' > "$T/past.jsonl"
row batch-row-past-context $A batch "$T/past.jsonl" -o "$T/past-out.jsonl" --no-progress
row api-past-context $BIN/python -c "
from alisa import generate, load_model
m, t = load_model('smollm2-135m'); generate(m, t, 'Hi', max_new_tokens=8192)"
long=$(printf 'word %.0s' $(seq 1 300))
row host-memory-1KiB $A generate "$long" --policy swa --caching-ratio 0.5 --retention host --host-memory 1KiB --max-new-tokens 2
row host-memory-without-host $A generate "Hi" --host-memory 1KiB --max-new-tokens 2
row dense-layers-1000 $A generate "Hi" --policy swa --caching-ratio 0.2 --dense-layers 1000
row dense-with-caching-ratio $A generate "Hi" --policy dense --caching-ratio 0.2
row plan-gpu-memory-100TB $A plan --model opt-13b --hardware v100-32gb --gpu-memory 100TB --batch 16 --prompt-len 1024
row plan-floor $A plan --model opt-13b --hardware v100-32gb --policy swa --caching-ratio 0.1 --prompt-len 128 --gen-len 32
row plan-min-budget-tokens $A plan --model opt-13b --hardware v100-32gb --policy swa --caching-ratio 0.1 --prompt-len 1024 --min-budget-tokens 512
row plan-prompt-past-context $A plan --model opt-13b --hardware v100-32gb --prompt-len 100000
row parallel-decode-without-parallel $A generate "Hi" --parallel-decode sharded
row sampling-without-do-sample $A generate "Hi" --temperature 0.7 --top-p 0.5 --max-new-tokens 2
row rank-timeout-nan $A batch "$T/in.jsonl" -o "$T/nan.jsonl" --rank-timeout nan
row do-sample-no $BIN/python -c "from alisa import SamplingOptions; SamplingOptions(do_sample='no')"
row temperature-inf $A generate "Hi" --do-sample --temperature inf
row experiment-option-typo $A experiment --config experiments/configs/smoke.toml --set options.perplexity.segment_tokenz=32 --set runtime.results_dir="$T/results"
row experiment-option-unswept-task $A experiment --config experiments/configs/smoke.toml --set options.xsum.limit=5 --set runtime.results_dir="$T/results"
row set-name-dotdot $A experiment --config experiments/configs/smoke.toml --set name=../x --set runtime.results_dir="$T/results"
# --- tracebacks
row truncated-gguf $A generate "Hi" --model "$T/truncated.gguf"
row segment-tokens-negative $A experiment --config experiments/configs/smoke.toml --set options.perplexity.segment_tokens=-5 --set runtime.results_dir="$T/results"
row sweep-batch-zero $A experiment --config experiments/configs/smoke.toml --set sweep.batch=0 --set runtime.results_dir="$T/results"
row phi-tiers-recompute-always $A generate "Hello there, how are you" --model "$T/phi" --gpu-memory 300KB --recompute always --max-new-tokens 4
row config-caching-ratio-none $BIN/python -c "from alisa import AlisaConfig; AlisaConfig(caching_ratio=None)"
row config-policy-none $BIN/python -c "from alisa import AlisaConfig; AlisaConfig(policy=None)"
row sampling-seed-x $BIN/python -c "from alisa import SamplingOptions; SamplingOptions(seed='x')"
row batchjob-kv-memory-inf $BIN/python -c "from alisa import BatchJob; BatchJob(input='in.jsonl', output='o.jsonl', kv_memory=float('inf'))"
row batchjob-config-none $BIN/python -c "from alisa import BatchJob; BatchJob(input='in.jsonl', output='o.jsonl', config=None)"
row generate-config-string $BIN/python -c "
from alisa import generate, load_model
m, t = load_model('smollm2-135m'); generate(m, t, 'Hi', 'swa')"
# --- unclear messages
row gpu-memory-zero $A generate "Hi" --gpu-memory 0
printf '{"id": "u", "prompt": "line\xe2\x80\xa8separator"}\n' > "$T/u2028.jsonl"
row jsonl-u2028 $A batch "$T/u2028.jsonl" -o "$T/u2028-out.jsonl" --max-new-tokens 2 --no-progress
printf '{"id": "a", "prompt": "Hi"}\n{"id": "big", "prompt": "x", "seed": 18446744073709551616}\n' > "$T/seed.jsonl"
row row-seed-oversized $A batch "$T/seed.jsonl" -o "$T/seed-out.jsonl" --no-progress
echo "{\"id\": \"long\", \"prompt\": \"$(printf 'word %.0s' $(seq 1 9000))\"}" > "$T/long.jsonl"
row row-prompt-too-long $A batch "$T/long.jsonl" -o "$T/long-out.jsonl" --kv-memory 64MiB --no-progress
grep -l "larger budget" "$T/log/row-prompt-too-long.txt" "$T/long-out.jsonl.failed" 2>/dev/null | sed 's/^/| (says larger budget: /;s/$/) | | |/'
row output-dev-null $A batch "$T/in.jsonl" -o /dev/null --no-progress
row profile-output-unwritable $A profile --model none --output /proc/alisa-none/p.json
echo '{"name": "mine", "overlap": true}' > "$T/partial.json"
row profile-partial $A generate "Hi" --profile "$T/partial.json"
row model-dir-empty $A generate "Hi" --model "$T/empty"
row falcon $A generate "Hi" --model "$T/falcon" --max-new-tokens 2
row version $A --version
# --- further inputs (not in the issue's table)
row output-is-a-directory $A batch "$T/in.jsonl" -o "$T" --no-progress
row output-folder-missing $A batch "$T/in.jsonl" -o "$T/nodir/o.jsonl" --max-new-tokens 2 --no-progress
row kv-memory-negative $A batch "$T/in.jsonl" -o "$T/neg.jsonl" --kv-memory -1
row gpu-memory-1e400 $A generate "Hi" --gpu-memory 1e400
row threads-1000 $A generate "Hi" --threads 1000 --max-new-tokens 2
row omp-num-threads-text env OMP_NUM_THREADS=abc $A generate "Hi" --max-new-tokens 2
row prompt-file-empty $A generate --prompt-file /dev/null
row plan-gen-len-zero $A plan --model opt-13b --hardware v100-32gb --gen-len 0
row experiment-config-missing $A experiment --config "$T/nosuch.toml"
row experiment-ratio-2 $A experiment --config experiments/configs/smoke.toml --set sweep.caching_ratio=2 --set runtime.results_dir="$T/results"
row experiment-threads-text $A experiment --config experiments/configs/smoke.toml --set runtime.threads=x --set runtime.results_dir="$T/results"
printf '{"id": "a", "prompt": "Hi"}\n{"id": "a", "prompt": "Yo"}\n' > "$T/dup.jsonl"
row duplicate-ids $A batch "$T/dup.jsonl" -o "$T/dup-out.jsonl" --no-progress
printf '{"id": null, "prompt": "Hi"}\n' > "$T/null.jsonl"
row id-null $A batch "$T/null.jsonl" -o "$T/null-out.jsonl" --no-progress
row chat-without-template $A generate "Hi" --chat --model "$T/short"
row api-threads-text $BIN/python -c "from alisa import use_threads; use_threads('4')"
# --- first hour
row help $A --help
s=$(date +%s.%N); $A --help > /dev/null; e=$(date +%s.%N)
echo "| (alisa --help wall time) | | $(echo "$e - $s" | bc) s |"
s=$(date +%s.%N); $A generate --caching-ration 0.5 > /dev/null 2>&1; e=$(date +%s.%N)
echo "| (usage error wall time) | | $(echo "$e - $s" | bc) s |"
echo "| (generate --help lines) | | $($A generate --help | wc -l) |"
row threads-flag-generate $A generate --help
grep -c -- "--threads" "$T/log/threads-flag-generate.txt" | sed 's/^/| (generate --help mentions --threads) | | /;s/$/ |/'
$A batch --help | grep -c -- "--threads" | sed 's/^/| (batch --help mentions --threads) | | /;s/$/ |/'
s=$(date +%s); row demo-chat $A generate --chat "What is the capital of France?" --max-new-tokens 32
echo "| (demo wall time) | | $(( $(date +%s) - s )) s |"
tail -3 "$T/log/demo-chat.txt" | sed 's/|/\\|/g;s/^/| (demo output) | | /;s/$/ |/'
row batch-chat $A batch examples/prompts.jsonl -o "$T/chat.jsonl" --chat --max-new-tokens 16 --no-progress
row summary-int8-short $A generate --chat "Hi" --policy swa --caching-ratio 0.2 --kv-bits 8 --max-new-tokens 8 --min-budget-tokens 0
grep "^\[alisa\]" "$T/log/summary-int8-short.txt" | sed 's/|/\\|/g;s/^/| (summary line) | | /;s/$/ |/'
row floor-keeps-everything $A generate --chat "Hi" --policy swa --caching-ratio 0.2 --max-new-tokens 8
row plan-weights-under-larger-budget $A plan --model smollm2-135m --hardware v100-32gb --gpu-memory 1GB --batch 64 --prompt-len 4096
s=$(date +%s); row smoke-sweep $A experiment --config experiments/configs/smoke.toml --set runtime.results_dir="$T/results"
echo "| (smoke sweep wall time) | | $(( $(date +%s) - s )) s |"
echo
echo "logs: $T/log"
