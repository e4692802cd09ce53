#!/usr/bin/env bash
# bench/trainer_scale.py on one CUDA GPU, unattended: our GRPO step beside TRL 1.16's loss
# step in bfloat16, one group of 4 rollouts at 4k and 16k tokens each, on Qwen2.5-0.5B's
# shapes and on Qwen2.5-7B's (all their layers; random weights built on the device), then
# our step under flex attention (shared prompts under a block mask: the path a CPU cannot
# train), under flash attention where flash-attn is installed (packed rows, no mask), and
# the logits' memory per chunk token (--head). Prints a table per run: peak GPU memory
# above the start, time per trained token, tokens/s; each run's figures as JSON too.
# Needs torch with CUDA, transformers and peft; trl 1.16 for the TRL columns (without it
# they say why); no vLLM. Designed to finish in under ten minutes on an
# H100/H200-class GPU (each process has 240 s; one that runs out is a row that says so).
#
#     bash bench/trainer_scale_gpu.sh [output directory]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.cache/trainer-scale-gpu}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1
if ! python -c "import overnight.trainer.grpo.head" 2>/dev/null; then
    # A bare machine: the project (its package-dir mapping) installed in place, no dependencies.
    python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
python -c "import trl; print('trl', trl.__version__)" || echo "trl not installed: the TRL columns will say so"

run() {
    local name="$1"; shift
    echo "== $name"
    python bench/trainer_scale.py --device cuda --dtype bfloat16 --repeats 1 --timeout 240 \
        --json "$out/$name.json" "$@" 2>"$out/$name.err" | tee "$out/$name.txt"
}

start=$SECONDS
run 0.5b --shape 0.5b --layers 0 --lengths 4096 16384
run 7b --shape 7b --layers 0 --lengths 4096 16384
run 0.5b-flex --shape 0.5b --layers 0 --lengths 4096 16384 --trl-lengths --attention flex_attention
# flash-attn's variable-length kernel: a micro-batch in one row, no mask (trainer/grpo/attention.py's VARLEN).
if python -c "import flash_attn" 2>/dev/null; then
    run 0.5b-flash --shape 0.5b --layers 0 --lengths 4096 16384 --trl-lengths --attention flash_attention_2
else
    echo "== 0.5b-flash: skipped, the flash-attn package is not installed on this machine"
fi
run head --head  # the logits' memory per chunk token (trainer/run/memory.py's LOGIT_COPIES)
echo "== done in $((SECONDS - start)) s; logs in $out"
