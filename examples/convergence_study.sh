#!/usr/bin/env bash
# FP8 against bf16 on real text (docs/convergence.md): GPT-125M and Llama-120M, each in bf16, FP8
# delayed scaling (HYBRID, amax history 1024, max) and FP8 current scaling, with the same seed,
# data order and schedule; then the Llama at 2x and 4x the peak learning rate, bf16 against FP8
# delayed, with bf16 runs from the next seed as yardsticks; optionally both models' bf16 runs
# again from another seed, the spread FP8's differences are read against. Curves (PNG) and a table of final losses land in WORKDIR/report/.
#   Usage: bash examples/convergence_study.sh WORKDIR [GROUP ...]
#   GROUP: gpt, llama, lr2x, lr4x (default: these four, in that order), seed (gpt-125m and
#   llama-120m in bf16 from SEED + 1, once with that seed's data order and once with --data-seed
#   SEED, the gpt and llama groups' batches; its reports seed_gpt and seed_llama set them beside
#   those groups' bf16 runs); data (prepare the data only) or report (curves and tables only, from
#   the runs' metrics.jsonl in WORKDIR/runs, e.g. copied from another machine: no data, no GPU). A GROUP/RUN
#   (e.g. lr2x/fp8_delayed) trains that one run of its group; list prints the runs the other
#   arguments name (default: every group's), with their settings, and trains nothing. lean: GPT-125M
#   in FP8 delayed with each lossy lean optimizer state (bf16 moments, an FP8 first moment, bf16
#   gradients; docs/training.md) on the gpt group's batches, reported beside its FP8 delayed run.
#   recipes: each model with the candidate recipes (FP8 delayed with an amax history of 1, rowwise
#   and blockwise scaling) on the gpt and llama groups' batches, reported beside their bf16 and
#   FP8 delayed runs; recipes2x: the same for Llama-120M at 2x the peak LR, beside lr2x's.
#   defaults: the evidence for the recipes' default scaling, two initialisations of each candidate
#   (FP8 delayed with an amax history of 1024 or 1, FP8 current) on the same batches, at the
#   study's rate and at 2x, for both models: the runs the other groups lack, reported beside theirs.
#   recipe1b: the GPT-1.3B recipe as shipped (examples/pretrain_gpt_1b_fp8.sh: sequence 2048,
#   micro-batches of 4, its learning rate and schedule) for RECIPE_ITERS (500) steps of RECIPE_GBS
#   (32) sequences on the study's training data, validated on the recipe's held-out split of it,
#   in bf16 and each candidate default; reported from a fifth of the run (step 100) on.
# Resumable: MINUTES=N stops the runs after about N minutes (fractions too), each with a checkpoint; the same
# command goes on where it stopped, and finished runs are kept. Data steps already done are kept.
# Data: by default a corpus of the Python packages installed here, test suites included, and the
# C and C++ headers of /usr/include (a stand-in for SlimPajama's GitHub subset, NOT SlimPajama;
# tools/make_sample_corpus.py --packages --sources /usr/include --test-suites; CORPUS_ROOTS and
# CORPUS_SOURCES name other folders), validation packages and projects held out whole, a VOCAB-token BPE trained on its training split. For SlimPajama (or any corpus in its
# layout) set CORPUS to its folder (holding train/ and validation/); for data already tokenized,
# set TRAIN_DATA, VALID_DATA (indexed-dataset prefixes) and TOKENIZER_MODEL.
# Sizes (defaults: the study's): ITERS steps of GBS x SEQ tokens (1500 x 64 x 1024, 98M tokens),
# SENS_ITERS for the learning-rate groups, validation every EVAL_INTERVAL steps over EVAL_ITERS
# batches; MODEL_ARGS is added to every run's flags (e.g. a shrunk model for a CPU try, with CPU=1).
# RUNS_AT_ONCE=N trains N runs at a time, the GPUS devices shared out among them: N <= GPUS gives
# each run GPUS/N of them (data parallel), N > GPUS puts N/GPUS runs on each GPU (a 125M model
# leaves an H200 room for more). Each line a run prints (out and error) starts with its name.
set -euo pipefail
WORKDIR=${1:?usage: bash examples/convergence_study.sh WORKDIR [gpt|llama|lr2x|lr4x|seed|lean|GROUP/RUN|data|report|list ...]}
shift
GROUPS_TO_RUN=() LIST=0
for group in "$@"; do
    if [ "$group" = list ]; then LIST=1; else GROUPS_TO_RUN+=("$group"); fi
done
REPORT_ONLY=0  # curves and tables from the runs' metrics alone: no data, no GPU
[ "${GROUPS_TO_RUN[*]}" = report ] && REPORT_ONLY=1
if [ ${#GROUPS_TO_RUN[@]} -eq 0 ]; then
    GROUPS_TO_RUN=(gpt llama lr2x lr4x)
    [ "$LIST" = 1 ] && GROUPS_TO_RUN+=(seed lean recipes recipes2x defaults recipe1b)
fi
if ! STOP_AT=$(python -c "import sys, time; m = float(sys.argv[1]); assert m > 0; print(int(time.time() + 60 * m))" \
                "${MINUTES:-100000}" 2> /dev/null); then
    echo "convergence_study.sh: MINUTES=${MINUTES} is not a positive number of minutes" >&2
    exit 2
fi
if [ "$LIST" = 0 ]; then  # a listing creates nothing
    mkdir -p "$WORKDIR"
    WORKDIR=$(CDPATH= cd -- "$WORKDIR" && pwd)
fi
cd "$(dirname "$0")/.."

ITERS=${ITERS:-1500}; SENS_ITERS=${SENS_ITERS:-500}
SEQ=${SEQ:-1024}; MBS=${MBS:-32}; GBS=${GBS:-64}
LR=${LR:-6e-4}; WARMUP_FRACTION=${WARMUP_FRACTION:-0.1}  # min LR: a tenth of the peak
EVAL_INTERVAL=${EVAL_INTERVAL:-100}; EVAL_ITERS=${EVAL_ITERS:-10}; LOG_INTERVAL=${LOG_INTERVAL:-10}
SEED=${SEED:-1234}; VOCAB=${VOCAB:-32768}; CORPUS_MB=${CORPUS_MB:-1200}
MODEL_ARGS=${MODEL_ARGS:-}
RECIPE_ITERS=${RECIPE_ITERS:-500}; RECIPE_GBS=${RECIPE_GBS:-32}; RECIPE_LR=${RECIPE_LR:-2e-4}
CUDA_GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
GPUS=${GPUS:-$((CUDA_GPUS > 0 ? CUDA_GPUS : 1))}
if [ "$LIST" != 1 ] && [ "$REPORT_ONLY" != 1 ] && [ "${CPU:-0}" != 1 ] && [ "$CUDA_GPUS" -eq 0 ]; then
    echo "convergence_study.sh: the study needs an NVIDIA GPU (torch sees none); for a tiny CPU try set" \
         "CPU=1 and shrink it (ITERS, GBS, SEQ, MODEL_ARGS: see tests/test_examples.py)" >&2
    exit 1
fi
GRAPH_ARGS=()
[ "$CUDA_GPUS" -gt 0 ] && GRAPH_ARGS=(--enable-cuda-graph)
RUNS_AT_ONCE=${RUNS_AT_ONCE:-1}
if ! [[ $RUNS_AT_ONCE =~ ^[1-9][0-9]*$ ]] \
    || { [ "$RUNS_AT_ONCE" -le "$GPUS" ] && [ $((GPUS % RUNS_AT_ONCE)) != 0 ]; } \
    || { [ "$RUNS_AT_ONCE" -gt "$GPUS" ] && [ $((RUNS_AT_ONCE % GPUS)) != 0 ]; }; then
    echo "convergence_study.sh: RUNS_AT_ONCE=$RUNS_AT_ONCE does not share $GPUS device(s) evenly; give a" \
         "divisor or a multiple of $GPUS" >&2
    exit 2
fi

kept() { echo "convergence_study: kept $1 from an earlier run (delete it to redo that step)"; }

prepare_data() {
    if [ -n "${TRAIN_DATA:-}" ]; then
        : "${VALID_DATA:?set VALID_DATA with TRAIN_DATA}" "${TOKENIZER_MODEL:?set TOKENIZER_MODEL with TRAIN_DATA}"
        return
    fi
    local corpus=${CORPUS:-$WORKDIR/corpus} workers
    workers=$(python -c 'import os; print(max(1, len(os.sched_getaffinity(0)) - 1))')
    if [ -z "${CORPUS:-}" ]; then
        if [ -f "$corpus/README.txt" ]; then kept "$corpus"
        else
            local sources=()  # CORPUS_SOURCES: folders of code in other languages, those that exist
            for folder in ${CORPUS_SOURCES-/usr/include}; do [ -d "$folder" ] && sources+=(--sources "$folder"); done
            # shellcheck disable=SC2086  # CORPUS_ROOTS is a list of folders
            python tools/make_sample_corpus.py --output "$corpus" --packages ${CORPUS_ROOTS:-} "${sources[@]}" \
                --test-suites --max-mb "$CORPUS_MB" --workers "$workers"
        fi
    fi
    TOKENIZER_MODEL=${TOKENIZER_MODEL:-$WORKDIR/tokenizer}
    if [ -f "$TOKENIZER_MODEL/tokenizer.json" ] || [ -f "$TOKENIZER_MODEL" ]; then kept "$TOKENIZER_MODEL"
    else python tools/train_tokenizer.py --input "$corpus/train" --type bpe --vocab-size "$VOCAB" \
             --output "$TOKENIZER_MODEL"; fi
    local split
    for split in train validation; do
        if [ -f "$WORKDIR/data/${split}_text_document.idx" ]; then kept "$WORKDIR/data/${split}_text_document"
        else python tools/preprocess_data.py --input "$corpus/$split" --output-prefix "$WORKDIR/data/$split" \
                 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --append-eod \
                 --workers "$workers"; fi
    done
    TRAIN_DATA=$WORKDIR/data/train_text_document; VALID_DATA=$WORKDIR/data/validation_text_document
}

finished() {  # the run's checkpoints reached its last iteration
    [ -f "$1/latest_checkpointed_iteration.txt" ] && [ "$(cat "$1/latest_checkpointed_iteration.txt")" = "$2" ]
}

describe() {  # NAME MODEL PRECISION PEAK_LR ITERATIONS SEED DATA_SEED: the run in words
    echo "$1 ($2, $3, peak LR $4, $5 iterations, seed $6, data seed $7)"
}

# train NAME MODEL PRECISION PEAK_LR ITERATIONS SEED DATA_SEED: one run, from its checkpoint if it has one.
# Returns 1 when the time is up (the run stopped with a checkpoint, or did not start); a failed run
# ends the study with its status.
train() {
    local name=$1 model=$2 precision=$3 lr=$4 iters=$5 seed=$6 data_seed=$7 dir=$WORKDIR/runs/$1
    if finished "$dir" "$iters"; then kept "run $name (finished)"; return 0; fi
    local left=$(( STOP_AT - $(date +%s) ))
    if [ "$left" -lt 120 ]; then return 1; fi
    if [[ $name == recipe1b/* ]]; then train_recipe "$@" "$left"; return; fi
    local precision_args=(--bf16)
    case $precision in
        bf16) ;;
        fp8_delayed_h1) precision_args+=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1
                                         --fp8-amax-compute-algo max) ;;
        fp8_delayed*) precision_args+=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024
                                       --fp8-amax-compute-algo max) ;;
        fp8_current) precision_args+=(--fp8-format hybrid --fp8-recipe current) ;;
        fp8_rowwise|fp8_blockwise) precision_args+=(--fp8-format e4m3 --fp8-recipe "${precision#fp8_}") ;;
    esac
    case $precision in  # the lean group's optimizer states
        *_bf16_moments) precision_args+=(--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) ;;
        *_fp8_exp_avg) precision_args+=(--exp-avg-dtype fp8 --exp-avg-sq-dtype bf16) ;;
        *_bf16_grads) precision_args+=(--main-grads-dtype bf16) ;;
    esac
    # Where a high learning rate may strain FP8, which layers do: per-layer FP8 health in metrics.jsonl
    # (tools/fp8_layer_table.py reads it).
    if [[ $precision == fp8_* && $name == lr* ]]; then precision_args+=(--log-fp8-layers); fi
    local min_lr warmup
    min_lr=$(python -c "print($lr / 10)"); warmup=$(python -c "print(max(1, round($iters * $WARMUP_FRACTION)))")
    echo "convergence_study: $(describe "$@") in $dir"
    # Stopping leaves a minute for the checkpoint; the trainer counts from its own start.
    local status=0 args
    # shellcheck disable=SC2086  # MODEL_ARGS is a word list on purpose
    args=(--model "$model" --seq-length "$SEQ" $MODEL_ARGS \
        --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$iters" \
        --lr "$lr" --min-lr "$min_lr" --lr-warmup-iters "$warmup" --lr-decay-style cosine \
        --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 --seed "$seed" --data-seed "$data_seed" \
        "${precision_args[@]}" ${GRAPH_ARGS[@]+"${GRAPH_ARGS[@]}"} \
        --train-data-path "$TRAIN_DATA" --valid-data-path "$VALID_DATA" \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
        --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" \
        --save "$dir" --load "$dir" --keep-last-checkpoints 1 \
        --exit-duration-in-mins "$(python -c "print(($left - 60) / 60)")")
    # The trainer's checks of the flags before torchrun: a mistake is one line and exit status 2
    # (explicit: a function called with || runs without set -e).
    WORLD_SIZE=$GPUS python -m megafp8.train --check-args "${args[@]}" >/dev/null || exit "$?"
    torchrun --standalone --nproc-per-node "$GPUS" -m megafp8.train "${args[@]}" || status=$?
    if [ "$status" != 0 ]; then echo "convergence_study: run $name failed (status $status)" >&2; exit "$status"; fi
    finished "$dir" "$iters" || return 1
}

# train_recipe NAME MODEL PRECISION PEAK_LR ITERATIONS SEED DATA_SEED SECONDS_LEFT: a run of the
# shipped GPT-1.3B recipe itself, with its own flags (examples/pretrain_fp8.sh), on the study's
# training data; RECIPE_SEQ and RECIPE_MBS, where set, replace its sequence and micro-batch.
train_recipe() {
    local name=$1 precision=$3 lr=$4 iters=$5 seed=$6 data_seed=$7 left=$8 dir=$WORKDIR/runs/$1
    local settings=(PRECISION=fp8) extra=""
    case $precision in
        bf16) settings=(PRECISION=bf16) ;;
        fp8_delayed) settings+=(FP8_RECIPE=delayed) ;;
        fp8_delayed_h1) settings+=(FP8_RECIPE=delayed); extra="--fp8-amax-history-len 1" ;;
        fp8_current) settings+=(FP8_RECIPE=current) ;;
    esac
    [ -n "${RECIPE_SEQ:-}" ] && settings+=(SEQ="$RECIPE_SEQ")
    [ -n "${RECIPE_MBS:-}" ] && settings+=(MBS="$RECIPE_MBS")
    echo "convergence_study: $(describe "${@:1:7}") in $dir, by examples/pretrain_gpt_1b_fp8.sh"
    local status=0
    env "${settings[@]}" GPUS="$GPUS" ITERS="$iters" GBS="$RECIPE_GBS" LR="$lr" \
        MIN_LR="$(python -c "print($lr / 10)")" WORKDIR="$dir" SAVE="$dir" LOG_INTERVAL="$LOG_INTERVAL" \
        DATA_PATH="$TRAIN_DATA" TOKENIZER_MODEL="$TOKENIZER_MODEL" \
        EXTRA_ARGS="$MODEL_ARGS $extra --seed $seed --data-seed $data_seed --eval-interval $EVAL_INTERVAL
                    --eval-iters $EVAL_ITERS --keep-last-checkpoints 1
                    --exit-duration-in-mins $(python -c "print(($left - 60) / 60)")" \
        bash examples/pretrain_gpt_1b_fp8.sh || status=$?
    if [ "$status" != 0 ]; then echo "convergence_study: run $name failed (status $status)" >&2; exit "$status"; fi
    finished "$dir" "$iters" || return 1
}

# report GROUP TITLE RUN[:LABEL]...: the group's curves and final losses, from what its runs logged
# so far (each labelled by its name's last part unless given).
report() {
    local group=$1 title=$2 runs=() labels=() run name
    shift 2
    for run in "$@"; do
        name=${run%%:*}
        [ -f "$WORKDIR/runs/$name/metrics.jsonl" ] || continue
        runs+=("$WORKDIR/runs/$name"); labels+=("$([ "$run" = "$name" ] && echo "${name#*/}" || echo "${run#*:}")")
    done
    [ ${#runs[@]} -gt 0 ] || return 0
    local options=()  # FP8's saturated fraction, once an FP8 run has logged it
    if cat "${runs[@]/%//metrics.jsonl}" | grep -qE '"fp8_saturation": [-0-9]'; then
        options=(--fields fp8_saturation)
    fi
    # Validation losses against the first run's, once it has evaluated.
    grep -q '"valid_loss"' "${runs[0]}/metrics.jsonl" && options+=(--relative)
    # Training losses against the first run's from the end of the warm-up (a tenth of the run);
    # the recipe's from a fifth (step 100 of 500), twice its warm-up.
    local iterations=$ITERS fraction=$WARMUP_FRACTION
    case $group in
        lr2x|lr4x|recipes2x|defaults2x_*) iterations=$SENS_ITERS ;;
        recipe1b) iterations=$RECIPE_ITERS fraction=0.2 ;;
    esac
    options+=(--train-from "$(python -c "print(max(1, round($iterations * $fraction)))")")
    # REPEATS: the runs come in settings of that many (initialisations); their means too, once
    # every run of them has logged
    if [ -n "${REPEATS:-}" ] && [ ${#runs[@]} = $# ]; then options+=(--repeats "$REPEATS"); fi
    python tools/plot_runs.py "${runs[@]}" --labels "${labels[@]}" --title "$title" --smooth 5 \
        --output "$WORKDIR/report/$group.png" --table "$WORKDIR/report/$group.md" ${options[@]+"${options[@]}"}
}

runs_of() {  # the runs of a group, or the one run GROUP/RUN: NAME MODEL PRECISION PEAK_LR ITERATIONS SEED DATA_SEED per line
    if [[ $1 == */* ]]; then
        local runs
        runs=$(runs_of "${1%%/*}") || return 2
        if ! grep "^$1 " <<< "$runs"; then
            echo "convergence_study.sh: unknown run '$1' (group ${1%%/*} has: $(cut -d' ' -f1 <<< "$runs" | paste -sd' '))" >&2
            return 2
        fi
        return 0
    fi
    local double quadruple
    double=$(python -c "print(2 * $LR)"); quadruple=$(python -c "print(4 * $LR)")
    case $1 in
        gpt|llama)
            local model=gpt-125m; [ "$1" = llama ] && model=llama-120m
            for precision in bf16 fp8_delayed fp8_current; do echo "$1/$precision $model $precision $LR $ITERS $SEED $SEED"; done ;;
        lr2x|lr4x)
            local peak=$double; [ "$1" = lr4x ] && peak=$quadruple
            for precision in bf16 fp8_delayed; do echo "$1/$precision llama-120m $precision $peak $SENS_ITERS $SEED $SEED"; done
            # bf16 again from the next seed, the yardsticks for FP8's gap (a high rate makes runs
            # erratic): with that seed's data order, and on the same batches (initialisation only);
            # and FP8 from that initialisation on the same batches: FP8's own spread.
            echo "$1/bf16_seed$((SEED + 1)) llama-120m bf16 $peak $SENS_ITERS $((SEED + 1)) $((SEED + 1))"
            echo "$1/bf16_init$((SEED + 1)) llama-120m bf16 $peak $SENS_ITERS $((SEED + 1)) $SEED"
            echo "$1/fp8_delayed_init$((SEED + 1)) llama-120m fp8_delayed $peak $SENS_ITERS $((SEED + 1)) $SEED" ;;
        seed)  # each model's bf16 run from the next seed: once with its data order, once on the same batches
            local model
            for model in gpt llama; do
                local preset=gpt-125m; [ $model = llama ] && preset=llama-120m
                echo "seed/${model}_bf16 $preset bf16 $LR $ITERS $((SEED + 1)) $((SEED + 1))"
                echo "seed/${model}_bf16_init $preset bf16 $LR $ITERS $((SEED + 1)) $SEED"
            done ;;
        lean)  # the gpt group's FP8 delayed run with each lossy optimizer state (remainders lose nothing)
            local states
            for states in bf16_moments fp8_exp_avg bf16_grads; do
                echo "lean/fp8_delayed_$states gpt-125m fp8_delayed_$states $LR $ITERS $SEED $SEED"
            done ;;
        recipes)  # the candidate recipes on each model's batches at the study's rate
            local model
            for model in gpt llama; do
                local preset=gpt-125m; [ $model = llama ] && preset=llama-120m
                for precision in $CANDIDATE_RECIPES; do
                    echo "recipes/${model}_$precision $preset $precision $LR $ITERS $SEED $SEED"
                done
            done ;;
        recipes2x)  # the same at 2x the peak rate, beside lr2x's bf16 and FP8 delayed runs
            for precision in $CANDIDATE_RECIPES; do
                echo "recipes2x/$precision llama-120m $precision $double $SENS_ITERS $SEED $SEED"
            done ;;
        defaults)  # from the next seed on the same batches: the candidates' second initialisation
            local model next=$((SEED + 1))
            for model in gpt llama; do
                local preset=gpt-125m; [ $model = llama ] && preset=llama-120m
                for precision in $CANDIDATE_DEFAULTS; do
                    echo "defaults/${model}_${precision}_init$next $preset $precision $LR $ITERS $next $SEED"
                done
            done
            # at 2x: GPT-125M whole (no other group runs it there); Llama-120M what lr2x and
            # recipes2x lack
            for precision in bf16 $CANDIDATE_DEFAULTS; do
                echo "defaults/gpt2x_$precision gpt-125m $precision $double $SENS_ITERS $SEED $SEED"
                echo "defaults/gpt2x_${precision}_init$next gpt-125m $precision $double $SENS_ITERS $next $SEED"
            done
            echo "defaults/llama2x_fp8_delayed_h1_init$next llama-120m fp8_delayed_h1 $double $SENS_ITERS $next $SEED"
            echo "defaults/llama2x_fp8_current llama-120m fp8_current $double $SENS_ITERS $SEED $SEED"
            echo "defaults/llama2x_fp8_current_init$next llama-120m fp8_current $double $SENS_ITERS $next $SEED" ;;
        recipe1b)  # the shipped GPT-1.3B recipe in bf16 and each candidate default
            for precision in bf16 $CANDIDATE_DEFAULTS; do
                echo "recipe1b/$precision gpt-1.3b $precision $RECIPE_LR $RECIPE_ITERS $SEED $SEED"
            done ;;
        data|report) ;;
        *) echo "convergence_study.sh: unknown group '$1' (give gpt, llama, lr2x, lr4x, seed, lean, recipes, recipes2x, defaults, recipe1b, data or report)" >&2
           return 2 ;;
    esac
}

CANDIDATE_RECIPES="fp8_delayed_h1 fp8_rowwise fp8_blockwise"
CANDIDATE_DEFAULTS="fp8_delayed fp8_delayed_h1 fp8_current"
declare -A TITLES=([gpt]="GPT-125M" [llama]="Llama-120M" [lr2x]="Llama-120M, 2x peak LR"
                   [lr4x]="Llama-120M, 4x peak LR")
for group in "${GROUPS_TO_RUN[@]}"; do runs_of "$group" > /dev/null || exit 2; done
if [ "$LIST" = 1 ]; then
    for group in "${GROUPS_TO_RUN[@]}"; do
        while read -r run; do
            # shellcheck disable=SC2086  # a run's settings are a word list
            describe $run
        done < <(runs_of "$group")
    done
    exit 0
fi

[ "$REPORT_ONLY" = 1 ] || prepare_data
[ "${GROUPS_TO_RUN[*]}" = data ] && { echo "convergence_study: data ready"; exit 0; }
RUNS=()
for group in "${GROUPS_TO_RUN[@]}"; do mapfile -t -O "${#RUNS[@]}" RUNS < <(runs_of "$group"); done

# run_slot SLOT: trains the runs no other slot has taken, one at a time, on the slot's share of the
# devices; returns 1 when the time is up, a failed run's status after it (and then no slot starts
# another run).
run_slot() {
    local slot=$1 share=$(( RUNS_AT_ONCE <= GPUS ? GPUS / RUNS_AT_ONCE : 1 )) run name
    if [ "$CUDA_GPUS" -gt 0 ]; then  # devices slot*share on, wrapping round where slots share one
        local visible
        IFS=, read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((CUDA_GPUS - 1)))}"
        export CUDA_VISIBLE_DEVICES
        CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${visible[*]:$(( slot * share % GPUS )):$share}")
    fi
    GPUS=$share
    for run in "${RUNS[@]}"; do
        name=${run%% *}
        [ -e "$TAKEN/failed" ] && return 0
        mkdir "$TAKEN/${name//\//.}" 2> /dev/null || continue  # atomic: one slot takes each run
        local status=0
        # shellcheck disable=SC2086  # a run's settings are a word list
        ( train $run ) > >(sed -u "s|^|[$name] |") 2> >(sed -u "s|^|[$name] |" >&2) \
            || status=$?  # train's exit ends only ( )
        if [ "$status" = 1 ]; then return 1; fi
        if [ "$status" != 0 ]; then touch "$TAKEN/failed"; return "$status"; fi
    done
}

time_up=0
if [ "$RUNS_AT_ONCE" = 1 ]; then
    for run in "${RUNS[@]}"; do
        # shellcheck disable=SC2086  # a run's settings are a word list
        train $run || { time_up=1; break; }
    done
else
    TAKEN=$(mktemp -d)
    trap 'rm -rf "$TAKEN"' EXIT
    slots=()
    for slot in $(seq 0 $((RUNS_AT_ONCE - 1))); do
        run_slot "$slot" &
        slots+=($!)
    done
    failure=0
    for pid in "${slots[@]}"; do
        status=0
        wait "$pid" || status=$?
        if [ "$status" = 1 ]; then time_up=1; elif [ "$status" != 0 ]; then failure=$status; fi
    done
    [ "$failure" = 0 ] || exit "$failure"
fi
for group in gpt llama lr2x lr4x; do
    mapfile -t names < <(runs_of "$group" | cut -d' ' -f1)
    report "$group" "${TITLES[$group]}" "${names[@]}"
done
for model in gpt llama; do
    compgen -G "$WORKDIR/runs/seed/${model}_bf16*/metrics.jsonl" > /dev/null || continue
    report "seed_$model" "${TITLES[$model]}, bf16 from two seeds" "$model/bf16:seed $SEED" \
        "seed/${model}_bf16:seed $((SEED + 1))" "seed/${model}_bf16_init:seed $((SEED + 1)), same data"
done
for model in gpt llama; do
    compgen -G "$WORKDIR/runs/recipes/${model}_*/metrics.jsonl" > /dev/null || continue
    # shellcheck disable=SC2046  # one word per run
    report "recipes_$model" "${TITLES[$model]}, FP8 recipes" "$model/bf16" "$model/fp8_delayed" \
        $(for p in $CANDIDATE_RECIPES; do echo "recipes/${model}_$p:${p#fp8_}"; done)
done
if compgen -G "$WORKDIR/runs/recipes2x/*/metrics.jsonl" > /dev/null; then
    # shellcheck disable=SC2046  # one word per run
    report recipes2x "${TITLES[lr2x]}, FP8 recipes" lr2x/bf16 lr2x/fp8_delayed \
        $(for p in $CANDIDATE_RECIPES; do echo "recipes2x/$p:${p#fp8_}"; done)
fi
if compgen -G "$WORKDIR/runs/defaults/*/metrics.jsonl" > /dev/null; then
    next=$((SEED + 1))
    declare -A LABELS=([bf16]="bf16" [fp8_delayed]="delayed h1024" [fp8_delayed_h1]="delayed h1"
                       [fp8_current]="current")
    pair() {  # RUN RUN_FROM_THE_NEXT_SEED PRECISION: both into PAIRS, labelled
        PAIRS+=("$1:${LABELS[$3]}" "$2:${LABELS[$3]}, seed $next")
    }
    for model in gpt llama; do  # each candidate from two initialisations, beside bf16's two
        PAIRS=()
        pair "$model/bf16" "seed/${model}_bf16_init" bf16
        pair "$model/fp8_delayed" "defaults/${model}_fp8_delayed_init$next" fp8_delayed
        pair "recipes/${model}_fp8_delayed_h1" "defaults/${model}_fp8_delayed_h1_init$next" fp8_delayed_h1
        pair "$model/fp8_current" "defaults/${model}_fp8_current_init$next" fp8_current
        REPEATS=2 report "defaults_$model" "${TITLES[$model]}, candidate defaults from seeds $SEED and $next" "${PAIRS[@]}"
    done
    PAIRS=()
    for p in bf16 $CANDIDATE_DEFAULTS; do pair "defaults/gpt2x_$p" "defaults/gpt2x_${p}_init$next" "$p"; done
    REPEATS=2 report defaults2x_gpt "GPT-125M, 2x peak LR, candidate defaults from seeds $SEED and $next" "${PAIRS[@]}"
    PAIRS=()
    pair lr2x/bf16 "lr2x/bf16_init$next" bf16
    pair lr2x/fp8_delayed "lr2x/fp8_delayed_init$next" fp8_delayed
    pair recipes2x/fp8_delayed_h1 "defaults/llama2x_fp8_delayed_h1_init$next" fp8_delayed_h1
    pair defaults/llama2x_fp8_current "defaults/llama2x_fp8_current_init$next" fp8_current
    REPEATS=2 report defaults2x_llama "${TITLES[lr2x]}, candidate defaults from seeds $SEED and $next" "${PAIRS[@]}"
fi
if compgen -G "$WORKDIR/runs/recipe1b/*/metrics.jsonl" > /dev/null; then
    report recipe1b "GPT-1.3B recipe, candidate defaults" recipe1b/bf16 recipe1b/fp8_delayed:"delayed h1024" \
        recipe1b/fp8_delayed_h1:"delayed h1" recipe1b/fp8_current:current
fi
if compgen -G "$WORKDIR/runs/lean/*/metrics.jsonl" > /dev/null; then
    mapfile -t names < <(runs_of lean | cut -d' ' -f1)
    report lean "GPT-125M, FP8 delayed with lean optimizer states" gpt/fp8_delayed:default "${names[@]}"
fi
if [ "$time_up" = 1 ]; then
    echo "convergence_study: MINUTES=${MINUTES:-} is up; run the same command again to go on"
    exit 3
fi
echo "convergence_study: done; curves and final losses in $WORKDIR/report/"
