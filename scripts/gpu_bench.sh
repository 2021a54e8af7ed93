#!/usr/bin/env bash
# The GPU benchmark runs quoted in BENCHMARKS.md, on a device with torch + triton + transformers
# (no install: run from the repository root). Stages: build tests sweep gemv profile l8 l8ab l8serial l8serve l8mix
# l8mixprof l8mixab l8mixprofab (the same two by environment variant: MIXAB, default prompt graphs off / on) dsv2
# dsv2prof (the DeepSeek step's kernels, batch 1 and 16) spec specid
# l8tp2 dsv2tp2 compiles, and the product path through `manta serve` (Ray, router, HTTP, KV store; needs Ray, NIXL
# and FastAPI on PYTHONPATH: ../shared/gpu/README.md): l8http (store on: a cold run, then the server restarted and the
# same prompts replayed) l8httpns (--no-kv-store) l8httptp2 (--tp 2 on two GPUs, store on) l8pd (two replicas sharing the GPU:
# mixed against prefill + decode, 2048-token prompts; MPS=1 under CUDA MPS, MPS_PCT=N with N% of the SMs per process, or per side:
# PD_SM="P D" (--prefill/--decode-sm-percent) and MIX_SM=N (--sm-percent)) l8route (`manta bench routing`: round robin / tree / events,
# two replicas sharing the GPU, KV store on), servetests (the GPU tests that need Ray and NIXL: PD on a GPU,
# pages loaded into a GPU pool; they talk to the server with the `openai` client: scripts/pack_device_client.sh),
# pdread (`scripts/nixl_read_bench.py --device cuda`: a hand-off's READ and checksums, GPU memory to GPU memory).
# l8prefill (`manta bench prefill`: MFU at 2,048 and 8,192-token prompts) gemms (the 8B layer's four products alone, TFLOP/s).
# FP8 (issue 25): l8fp8prof (the 8B shape's FP8 step by kernel, batch 64 and 1) fp8mid (2-63 rows: products and steps) dsv2fp8prof (block FP8 DeepSeek's batch-1 step by kernel) l8fp8 (batch 1/64, --quantization fp8) l8fp8ab (batch 1, one-row kernels off / on) gemvfp8
# ab (AB_OLD=DIR: an older tree's workers/ and attention/ against this one, AB_FLAGS, `python3 -P`)
# gemvfp8ab (the step's FP8 one-row launches swept on this GPU, then batch 1 with the fastest against FP8_LAUNCH's)
# (`bench_gemv --fp8`) fp8tmaab (FP8 decode batches, MANTA_FP8_TMA=0 / 1 / 1 / 0; TMA_BATCH, TMA_FLAGS) fp8rowsab (FP8 decode batches and prefill, MANTA_FP8_ROWS=0 / 1) l8fp8serve (in-process serve workload) l8fp8http
# (through `manta serve`: bf16, --quantization fp8, and FP8 weights + --kv-cache-dtype fp8_e4m3, one after another;
# FP8_HTTP_MODES picks; fp8kvnotma: the last with MANTA_FP8_TMA=0; fp8kvmma / fp8kvnomma: with MANTA_FP8_KV_MMA=1 / 0) dsv2fp8 (DeepSeek-V2-Lite shape in block FP8) dsv2q (bf16, --quantization fp8 with TMA on / off, block FP8) kvmma (the FP8 cache's
# keys-on-M decode: tests, kernel probe, step A/B MANTA_FP8_KV_MMA=0 / 1 / 1 / 0, the logits error of a first decode step of 16 prompts together) l8kvfp8 (batch 1/64 with the FP8 KV cache,
# and the logits error it adds: scripts/kv_fp8_error.py).
# (default: build tests profile l8 l8serve dsv2 spec). Each writes JSON to ${OUT:-/tmp/out};
# models are built once under /tmp (`build` makes both in parallel: run it in the background beside `tests`, then `wait`).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M="python3 -m cluster.cli"
F=${F:-"--device cuda --page-size 16 --max-context-len 4096 --mem-fraction 0.6"}
# DUMMY=1: models built without weight files and served on random weights drawn at load
# (--load-format dummy): no 16 GB to write or read. Only for stages that load through `manta` with $F.
F="$F${DUMMY:+ --load-format dummy}"
FW=${F// --load-format dummy/}  # an FP8 checkpoint's own weights (dummy weights are unquantized: refused for it)
stages=${*:-build tests profile l8 l8serve dsv2 spec}
build() {  # build DIR ARGS...: a random-weight checkpoint, once (an FP8 format's weights are written even with DUMMY:
  local d=$1 nw=${DUMMY:+--no-weights}; shift  # the format is in them)
  case " $* " in *" --quantization "*) nw= ;; esac
  [ -f "$d/config.json" ] || $M make-model "$d" "$@" --dtype bfloat16 $nw >/dev/null
}
# `manta serve` in its own process group, and the serve workload over HTTP (streamed, usage per chunk).
SERVE_MODEL=${SERVE_MODEL:-/tmp/l8} PORT=${PORT:-8100} SPID=
WORK=${WORK:-"--num-prompts 200 --input-len 1024 --output-len 1024 --request-rate 16"}
serve_model() { [ "$SERVE_MODEL" != /tmp/l8 ] || build /tmp/l8 --preset llama-3.1-8b; }
serve_start() {  # serve_start NAME FLAGS...: start, wait for /health (the log goes to $OUT/serve_NAME.log)
  local name=$1 t0=$SECONDS; shift
  setsid $M serve --model "$SERVE_MODEL" --port "$PORT" "$@" > "$OUT/serve_$name.log" 2>&1 & SPID=$!
  for _ in $(seq 600); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" \
      2>/dev/null && { echo "serve $name up after $((SECONDS - t0)) s"; return 0; }
    kill -0 $SPID 2>/dev/null || { echo "serve $name died"; tail -30 "$OUT/serve_$name.log"; return 1; }
    sleep 1
  done; echo "serve $name did not come up"; return 1
}
serve_stop() {  # SIGINT to the server (it drains the KV cache, flushes the store, stops Ray), then the group
  kill -INT $SPID 2>/dev/null; local t0=$SECONDS
  while kill -0 $SPID 2>/dev/null && [ $((SECONDS - t0)) -lt 180 ]; do sleep 0.5; done
  echo "serve stopped in $((SECONDS - t0)) s"; kill -KILL -- -$SPID 2>/dev/null; SPID=
}
mps_start() {  # CUDA MPS for this stage's processes (a user daemon: the GPU's own settings are left as they are)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS daemon up" || echo "MPS daemon did not start"
  # MPS_PCT=N: every client (both replicas) may occupy at most N% of the SMs, so neither side's
  # kernels can fill the GPU while the other's wait (MPS=1 alone: decode steps stretched to 138 ms)
  [ -n "${MPS_PCT:-}" ] && export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$MPS_PCT
}
mps_clients() {  # under MPS=1: the MPS servers and the GPU's compute processes (MPS clients run inside the server)
  [ "${MPS:-0}" = 1 ] || return 0
  echo "MPS servers: $(echo get_server_list | nvidia-cuda-mps-control 2>&1 | tr '\n' ' ')"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1 | sed 's/^/  gpu process: /'
}
mps_stop() { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; }
serve_warmed() {  # wait (up to 180 s) until the replica's ranks have warmed their host tiers from the store
  python3 - "$PORT" <<'PY'
import re, sys, time, urllib.request
t0 = time.time()
while time.time() - t0 < 180:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
    val = lambda name: sum(float(v) for v in re.findall(r"^%s\{[^}]*\} (\S+)" % name, text, re.M))
    pages, warming = val("manta:kvstore_warm_pages_total"), val("manta:kvstore_warming")
    if pages > 0 and warming == 0 or time.time() - t0 > 60 and pages == 0:
        break
    time.sleep(1)
print(f"host tiers warmed: {pages:.0f} pages, {time.time() - t0:.1f} s after /health")
PY
}
http_bench() {  # http_bench NAME: the workload against the running server; JSON + a /metrics scrape
  # PROFILE=1: py-spy samples the server and the replica actor for 8 s in the middle of the run.
  if [ -n "${PROFILE:-}" ]; then
    ( sleep ${PROFILE_AT:-12}; for role in server:"cluster.cli serve" replica:"ray::Replica" rank:"ray::RankWorker"; do pid=$(pgrep -f "${role#*:}" | head -1)
        ${PYSPY:-py-spy} record --nonblocking -d 8 -r 100 -f speedscope -o "$OUT/prof_$1_${role%%:*}.json" \
          --pid "$pid" >/dev/null 2>&1 & done; wait ) & PROF=$!
  fi
  $M bench serve --model "$SERVE_MODEL" --url "http://127.0.0.1:$PORT" $WORK --server-pid "$SPID" --out "$OUT/$1.json" 2>&1 \
    | grep -v "INFO\|Warning"; [ -z "${PROFILE:-}" ] || wait $PROF
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
    > "$OUT/$1_metrics.txt"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/admin/replicas').read().decode())" \
    > "$OUT/$1_replicas.json"  # each replica's stats: the KV store's load/prefill rates, loads, bypasses
  grep -E "^manta:(kvstore_(hit|query|warm)_pages|kvstore_host_admissions|replica_output_(messages|steps))" "$OUT/$1_metrics.txt"
  python3 -c "import re,sys; t=open(sys.argv[1]).read(); print('time to first token by stage, mean ms:', {s: round(1e3 *
    sum(map(float, re.findall(r'_sum\{[^}]*stage=\"%s\"[^}]*\} (\S+)' % s, t))) / max(1.0, sum(map(float,
    re.findall(r'_count\{[^}]*stage=\"%s\"[^}]*\} (\S+)' % s, t)))), 1) for s in ('to_engine_server', 'to_engine_transit',
    'engine', 'from_engine_transit', 'from_engine_server')})" "$OUT/$1_metrics.txt"
  python3 -c "import json,sys; [print(r['name'], {k: v for k, v in ((r.get('stats') or {}).get('kvstore') or {}).items()
    if k in ('loads', 'hit_pages', 'host_admissions', 'short_loads', 'early_stops', 'bypassed', 'busy', 'probe_timeouts', 'ttft_tokens_per_s_loaded',
             'ttft_tokens_per_s_computed', 'saved_pages', 'drained_pages', 'load_phase_ms')},
    [{k: v for k, v in rk.items() if k.startswith(('read_', 'offload_prefetch_', 'offload_load_', 'offload_warm')) or k in ('pages_read', 'pages_present', 'offload_prefetched_pages')}
     for rk in ((r.get('stats') or {}).get('kvstore') or {}).get('ranks', [])]) for r in json.load(open(sys.argv[1]))['replicas']]" \
    "$OUT/$1_replicas.json" 2>&1 | tail -2
  ps -eo pid,pcpu,rss,args | grep -E "ray::(Replica|RankWorker|KVStore)|cluster.cli serve" | grep -v grep
}
ab_batch1() {  # ab_batch1 TAG "ENGINE FLAGS" VARIANT...: batch-1 latency of /tmp/l8 under each variant's environment
  local tag=$1 flags=$2 v; shift 2
  for v in "$@"; do echo "--- $v"; local name=${v//[^A-Za-z0-9]/_}
    env $v $M bench latency --model /tmp/l8 $F $flags --batch 1 --steps 48 --input-len 512 \
      --out "$OUT/l8_latency${tag}_${name:0:48}.json" 2>&1 | grep -v Warning | tail -4; done
}
for s in $stages; do
  echo "=== $s $(date -u +%FT%TZ)"
  case $s in
    build) build /tmp/l8 --preset llama-3.1-8b & build /tmp/dsv2 --preset deepseek-v2-lite & wait ;;
    l8tp2) build /tmp/l8 --preset llama-3.1-8b  # 2 GPUs: NCCL, torch multiprocessing ranks
        $M bench latency --model /tmp/l8 $F --tp 2 --batch 1 64 --steps 48 --input-len 512 --out "$OUT/l8_latency_tp2.json" ;;
    dsv2tp2) build /tmp/dsv2 --preset deepseek-v2-lite
        $M bench latency --model /tmp/dsv2 $F --tp 2 --batch 1 16 --steps 24 --input-len 512 \
          --out "$OUT/dsv2_latency_tp2.json"
        $M bench offline --model /tmp/dsv2 $F --tp 2 --num-prompts 64 --input-len 512 --output-len 128 \
          --out "$OUT/dsv2_offline_tp2.json" ;;
    tests) python3 -u -m pytest -v -p no:cacheprovider -rfE --durations=10 tests/test_rope_store.py tests/test_gemv.py tests/test_argmax_kernel.py \
             tests/test_decode_prep_kernels.py tests/test_sampler.py \
             tests/test_gpu_kernels.py tests/test_gpu_engine.py tests/test_gpu_speculative.py \
             tests/test_gpu_encoder_decoder.py tests/test_fused_moe.py tests/test_moe_kernels.py tests/test_fp8_heads.py tests/test_fp8_gemm.py tests/test_gpu_fp8.py \
             tests/test_gpu_kv_fp8.py 2>&1 | grep --line-buffered -v "Warning\|warn" \
             | tee "$OUT/tests.log" | grep -v " PASSED\| SKIPPED" ;;  # a line per test in tests.log: a run cut by the call's limit still names its failures
    servetests) python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gpu_pd.py tests/test_kvstore_serving.py -k "gpu" \
             2>&1 | grep -v "Warning\|warn" | tee "$OUT/servetests.log" ;;  # needs Ray, NIXL, FastAPI (../shared/gpu), openai (pack_device_client.sh)
    pdread) python3 scripts/nixl_read_bench.py --device cuda --mib 256 --out "$OUT/nixl_read_gpu.json" 2>&1 \
             | grep -v "NIXL\|^\[" ;;  # a PD hand-off's NIXL READ, GPU memory to GPU memory (needs NIXL)
    compiles) python3 scripts/compiles_after_start.py llama; python3 scripts/compiles_after_start.py deepseek_v2 ;;
    sweep) for kv in ${SWEEP_KV:-bf16}; do  # SWEEP_KV="bf16 fp8": the cache dtypes; SWEEP_CASES="B:ctx ...": the shapes
          python3 -m attention.bench_kernels --sweep --kv-dtype "$kv" ${SWEEP_CASES:+--cases $SWEEP_CASES} 2>&1 \
            | grep -v Warning | tee "$OUT/decode_sweep_$kv.txt"; done ;;
    gemv) python3 -m workers.layers.bench_gemv --out "$OUT/gemv_sweep.json" 2>&1 | grep -v Warning ;;
    gemvfp8) python3 -m workers.layers.bench_gemv --fp8 --out "$OUT/gemv_sweep_fp8.json" 2>&1 | grep -v Warning ;;
    gemvfp8ab) build /tmp/l8 --preset llama-3.1-8b  # this GPU's fastest FP8 one-row launches (the step's four products), then
        # FP8 batch 1 with FP8_LAUNCH's and with them (MANTA_GEMV_CONFIGS), default / swept / default
        python3 -m workers.layers.bench_gemv --fp8 --only 5 6 10 11 --emit-configs "$OUT/gemv_fp8_best.txt" \
          --out "$OUT/gemv_sweep_fp8_step.json" 2>&1 | grep -v Warning; echo "best: $(cat "$OUT/gemv_fp8_best.txt")"
        ab_batch1 _fp8 "--quantization fp8" "MANTA_GEMV=1" "MANTA_GEMV_CONFIGS=$(cat "$OUT/gemv_fp8_best.txt")" \
          "MANTA_GEMV=1" ;;
    fp8rowsab) build /tmp/l8 --preset llama-3.1-8b  # FP8 (--quantization fp8): norms and SiLU·up writing their rows
        # quantized for the W8A8 products (MANTA_FP8_ROWS=1) or 16-bit rows (=0): decode batches, then prefill
        i=0; for v in ${ROWS_ORDER:-0 1 1 0}; do i=$((i + 1)); echo "--- MANTA_FP8_ROWS=$v"
          MANTA_FP8_ROWS=$v $M bench latency --model /tmp/l8 $F --quantization fp8 --batch ${ROWS_BATCH:-64 128} --steps 32 \
            --input-len 512 --out "$OUT/fp8rows_latency_${i}_$v.json" 2>&1 | grep "^batch"; done
        for v in ${ROWS_PREFILL:-0 1}; do echo "--- prefill, MANTA_FP8_ROWS=$v"
          MANTA_FP8_ROWS=$v $M bench prefill --model /tmp/l8 $F --quantization fp8 --num-prompts 32 --input-len 2048 \
            --out "$OUT/fp8rows_prefill_$v.json" 2>&1 | grep -v "Warning\|INFO" | tail -3; done ;;
    fp8tmaab) build /tmp/l8 --preset llama-3.1-8b  # FP8 decode batches: products on the TMA kernel (MANTA_FP8_TMA=1) or not
        i=0; for v in ${TMA_ORDER:-0 1 1 0}; do i=$((i + 1)); echo "--- MANTA_FP8_TMA=$v"
          MANTA_FP8_TMA=$v $M bench latency --model /tmp/l8 $F --quantization fp8 ${TMA_FLAGS:-} --batch ${TMA_BATCH:-8 16 32 64 96 128} \
            --steps 32 --input-len 512 --out "$OUT/fp8tma_latency_${i}_$v.json" 2>&1 | grep "^batch"; done ;;
    l8fp8ab) build /tmp/l8 --preset llama-3.1-8b  # FP8 batch 1: fused one-row kernels (MANTA_GEMV=1) or not
        ab_batch1 _fp8 "--quantization fp8" ${L8AB:-"MANTA_GEMV=0" "MANTA_GEMV=1"} ;;
    l8ab) build /tmp/l8 --preset llama-3.1-8b  # batch 1 with the one-row kernels / PDL switched off
        ab_batch1 "" "" ${L8AB:-"MANTA_GEMV=0 MANTA_PDL=0" "MANTA_PDL=0" "MANTA_GEMV=1"} ;;
    profile) build /tmp/l8 --preset llama-3.1-8b
        python3 scripts/profile_decode.py /tmp/l8 1 ${DUMMY:+--load-format dummy} --out "$OUT/l8_profile_b1.json" 2>&1 | grep -v Warning ;;
    l8fp8prof) build /tmp/l8 --preset llama-3.1-8b  # where the FP8 step goes (--quantization fp8, FP8 KV cache too with KVFP8=1)
        for b in ${PROF_BATCH:-64 1}; do echo "--- batch $b"
          python3 scripts/profile_decode.py /tmp/l8 "$b" --quantization fp8 ${KVFP8:+--kv-cache-dtype fp8_e4m3} ${DUMMY:+--load-format dummy} --steps 16 \
            --out "$OUT/l8fp8_profile_b$b.json" 2>&1 | grep -v "Warning\|INFO" | head -${PROF_LINES:-60}; done ;;
    ab) build /tmp/l8 --preset llama-3.1-8b  # the step with an older tree's packages (AB_OLD=DIR holding its workers/ and
        # attention/) against this one, in AB_ORDER, flags AB_FLAGS. `python3 -P`: `-m` would put the working directory,
        # and so this tree's packages, ahead of PYTHONPATH.
        i=0; for v in ${AB_ORDER:-old new old new}; do i=$((i + 1)); echo "--- $v"
          [ "$v" = old ] && pp="$AB_OLD:$PYTHONPATH" || pp="$PYTHONPATH"
          PYTHONPATH="$pp" python3 -P -m cluster.cli bench latency --model /tmp/l8 $F ${AB_FLAGS:-} --steps 32 --input-len 512 \
            --out "$OUT/ab_${i}_$v.json" 2>&1 | grep "^batch"; done ;;
    l8) build /tmp/l8 --preset llama-3.1-8b
        $M bench latency --model /tmp/l8 $F --batch 1 64 --steps 48 --input-len 512 --out "$OUT/l8_latency.json" ;;
    l8fp8) build /tmp/l8 --preset llama-3.1-8b  # the same checkpoint quantized at load: per-channel FP8 weights
        $M bench latency --model /tmp/l8 $F --quantization fp8 --batch 1 64 --steps 48 --input-len 512 \
          --out "$OUT/l8_latency_fp8.json" ;;
    fp8mid) build /tmp/l8 --preset llama-3.1-8b  # FP8 at 2-63 rows (W8A16 tiles): the products, then the step beside bf16
        python3 -m workers.layers.bench_fp8 --sweep --m 2 4 8 16 32 48 --scales channel 2>&1 | tee "$OUT/bench_fp8_mid.txt"
        for q in "" "--quantization fp8"; do $M bench latency --model /tmp/l8 $F $q --batch 1 2 4 8 16 32 64 --steps 32 \
          --input-len 512 --out "$OUT/l8_latency_mid${q:+_fp8}.json" 2>&1 | grep "p50\|fraction"; done ;;
    l8fp8serve) build /tmp/l8 --preset llama-3.1-8b
        $M bench serve --model /tmp/l8 $F --quantization fp8 --num-prompts 200 --input-len 1024 --output-len 1024 \
          --request-rate 16 --out "$OUT/l8_serve_fp8.json" ;;
    l8fp8http) serve_model  # `manta serve` bf16 / --quantization fp8 / + --kv-cache-dtype fp8_e4m3, KV store on
        KV=${KV_DIR:-/tmp/kvstore}
        for mode in ${FP8_HTTP_MODES:-bf16 fp8 fp8kv}; do rm -rf "$KV"
          tma=1 mma=${MANTA_FP8_KV_MMA:-}; case $mode in bf16) q= ;; fp8) q="--quantization fp8" ;; fp8kv) q="--quantization fp8 --kv-cache-dtype fp8_e4m3" ;;
            fp8kvnotma) q="--quantization fp8 --kv-cache-dtype fp8_e4m3"; tma=0 ;; kv) q="--kv-cache-dtype fp8_e4m3" ;;
            fp8kvmma) q="--quantization fp8 --kv-cache-dtype fp8_e4m3"; mma=1 ;; fp8kvnomma) q="--quantization fp8 --kv-cache-dtype fp8_e4m3"; mma=0 ;; esac
          MANTA_FP8_TMA=$tma MANTA_FP8_KV_MMA=$mma serve_start "$mode" $F $q --kv-store $KV --kv-store-disk-gb ${KV_DISK_GB:-8} \
            && { http_bench "l8_http_$mode"; serve_stop; }
        done; rm -rf "$KV" ;;
    kvmma) build /tmp/l8 --preset llama-3.1-8b  # the FP8 cache's decode with e4m3 keys on the MMA's M side (MANTA_FP8_KV_MMA):
        # its GPU tests, the kernel alone at each stage count beside the shipped loads, the step A/B, the logits error it adds
        python3 -m pytest -q -p no:cacheprovider -rfE tests/test_decode_mma.py 2>&1 | grep -v "Warning\|warn" | grep -v "^[0-9.]*s \(call\|setup\|teardown\)"
        python3 scripts/fp8_kv_decode_probe.py --cases 1:4096 16:2048 64:1024 128:1536 192:1536 256:1024 --launches default \
          --mma-stages 3 4 5 --out "$OUT/kvmma_probe.json" 2>&1 | grep -v Warning
        i=0; for v in ${KVMMA_ORDER:-0 1 1 0}; do i=$((i + 1)); echo "--- MANTA_FP8_KV_MMA=$v"
          MANTA_FP8_KV_MMA=$v $M bench latency --model /tmp/l8 $F --quantization fp8 --kv-cache-dtype fp8_e4m3 \
            --batch ${KVMMA_BATCH:-1 16 64 128} --steps 32 --input-len ${KVMMA_LEN:-1536} --out "$OUT/kvmma_latency_${i}_$v.json" \
            2>&1 | grep "p50\|fraction"; done
        for v in 0 1; do echo "--- logits error, MANTA_FP8_KV_MMA=$v"; MANTA_FP8_KV_MMA=$v python3 scripts/kv_fp8_error.py /tmp/l8 $F \
          --kv-cache-tokens 32768 --num-prompts 16 --input-len 1024 --decode --together --out "$OUT/kvmma_error_$v.json" 2>&1 | grep -v "INFO\|Warning" | tail -7; done ;;
    l8kvfp8) build /tmp/l8 --preset llama-3.1-8b  # the FP8 KV cache: decode steps, and the logits error it adds
        $M bench latency --model /tmp/l8 $F --kv-cache-dtype fp8_e4m3 --batch 1 64 --steps 48 --input-len 512 \
          --out "$OUT/l8_latency_kvfp8.json"
        $M bench latency --model /tmp/l8 $F --quantization fp8 --kv-cache-dtype fp8_e4m3 --batch 1 64 --steps 48 \
          --input-len 512 --out "$OUT/l8_latency_fp8_kvfp8.json"
        python3 scripts/kv_fp8_error.py /tmp/l8 $F --kv-cache-tokens 32768 --num-prompts 16 --input-len 1024 --out "$OUT/l8_kvfp8_error.json" \
          2>&1 | grep -v "INFO\|Warning" | tail -6 ;;
    dsv2fp8) build /tmp/dsv2fp8 --preset deepseek-v2-lite --quantization fp8-block  # DeepSeek-V3's FP8 format
        $M bench latency --model /tmp/dsv2fp8 $FW --batch 1 16 --steps 24 --input-len 512 --out "$OUT/dsv2_latency_fp8.json" ;;
    dsv2q) build /tmp/dsv2 --preset deepseek-v2-lite  # DeepSeek-V2-Lite's step: bf16, --quantization fp8 (channel FP8,
        build /tmp/dsv2fp8 --preset deepseek-v2-lite --quantization fp8-block  # experts too; TMA on, then off), block FP8
        for v in ${DSV2Q:-bf16 fp8 fp8notma block}; do echo "--- $v"; m=/tmp/dsv2 q= tma=1 f=$F
          case $v in fp8) q="--quantization fp8" ;; fp8notma) q="--quantization fp8"; tma=0 ;; block) m=/tmp/dsv2fp8 f=$FW ;; esac
          MANTA_FP8_TMA=$tma $M bench latency --model $m $f $q --batch 1 16 --steps 24 --input-len 512 \
            --out "$OUT/dsv2q_latency_$v.json" 2>&1 | grep "p50\|fraction\|Error"; done ;;
    dsv2fp8prof) build /tmp/dsv2fp8 --preset deepseek-v2-lite --quantization fp8-block  # where block FP8's batch-1 step goes
        for b in ${PROF_BATCH:-1}; do echo "--- batch $b, PDL off"  # (against dsv2prof's bf16: which products lose the fusions)
          MANTA_PDL=0 python3 scripts/profile_decode.py /tmp/dsv2fp8 "$b" --steps 24 --out "$OUT/dsv2fp8_profile_b${b}.json" \
            2>&1 | grep -v Warning | head -${PROF_LINES:-120}; done ;;
    gemms) python3 scripts/prefill_gemms.py --tokens 1024 2048 8192 2>&1 | tee "$OUT/prefill_gemms.txt" ;;  # the products alone
    l8prefill) build /tmp/l8 --preset llama-3.1-8b  # prefill MFU against the dense bf16 peak (issue 26)
        $M bench prefill --model /tmp/l8 $F --num-prompts 64 --input-len 2048 --out "$OUT/l8_prefill_2048.json"
        $M bench prefill --model /tmp/l8 ${F/4096/16384} --num-prompts 16 --input-len 8192 \
          --out "$OUT/l8_prefill_8192.json" ;;
    l8serial) build /tmp/l8 --preset llama-3.1-8b
        $M bench latency --model /tmp/l8 $F --batch 1 64 --steps 48 --input-len 512 --disable-overlap-schedule \
          --out "$OUT/l8_latency_no_overlap.json" ;;
    l8mixprof|l8mixprofab) build /tmp/l8 --preset llama-3.1-8b  # MIXED steps: 192 decodes + one new prompt of N tokens
        ab=${MIXAB:-}; [ "$s" = l8mixprof ] || ab=${MIXAB:-"MANTA_PROMPT_GRAPHS=0 MANTA_PROMPT_GRAPHS=1"}
        for v in ${ab:--}; do for n in ${MIX_PROFILE:-256 512 1024}; do echo "--- ${v#-} prompt $n"
          env ${v#-} python3 scripts/profile_decode.py /tmp/l8 192 --input-len 1024 --prefill "$n" --steps 20 \
            --out "$OUT/l8_profile_mixed_p$n${ab:+_${v//=/_}}.json" 2>&1 | grep -v Warning | head -16; done; done ;;
    l8mix|l8mixab) build /tmp/l8 --preset llama-3.1-8b  # the serve workload by prompt tokens allowed beside decodes
        ab=${MIXAB:-}; [ "$s" = l8mix ] || ab=${MIXAB:-"MANTA_PROMPT_GRAPHS=0 MANTA_PROMPT_GRAPHS=1"}
        for v in ${ab:--}; do for m in ${MIX:-0 512 768 1024}; do echo "--- ${v#-} mixed-prefill-tokens $m"
          env ${v#-} $M bench serve --model /tmp/l8 $F --mixed-prefill-tokens "$m" --num-prompts 200 --input-len 1024 \
            --output-len 1024 --request-rate 16 --out "$OUT/l8_serve_mix$m${ab:+_${v//=/_}}.json" 2>&1 \
            | grep -v "INFO\|Warning"; done; done ;;
    l8serve) build /tmp/l8 --preset llama-3.1-8b
        $M bench serve --model /tmp/l8 $F --num-prompts 200 --input-len 1024 --output-len 1024 \
          --request-rate 16 --out "$OUT/l8_serve.json" ;;
    dsv2) build /tmp/dsv2 --preset deepseek-v2-lite
        $M bench latency --model /tmp/dsv2 $F --batch 1 16 --steps 24 --input-len 512 --out "$OUT/dsv2_latency.json"
        $M bench offline --model /tmp/dsv2 $F --num-prompts 64 --input-len 512 --output-len 128 \
          --out "$OUT/dsv2_offline.json" ;;
    dsv2prof) build /tmp/dsv2 --preset deepseek-v2-lite  # where the DeepSeek decode step goes: batch 1 and 16, PDL off / on
        for b in ${PROF_BATCH:-1 16}; do for v in MANTA_PDL=0 MANTA_PDL=1; do echo "--- batch $b $v"
          env $v python3 scripts/profile_decode.py /tmp/dsv2 "$b" --steps 24 --out "$OUT/dsv2_profile_b${b}_${v//=/_}.json" \
            2>&1 | grep -v Warning | head -${PROF_LINES:-120}; done; done ;;
    spec) build /tmp/l8 --preset llama-3.1-8b
        build /tmp/l1b --arch llama --layers 16 --hidden 2048 --heads 32 --kv-heads 8 --intermediate 8192 --vocab 128256 \
          --max-position 8192
        $M bench spec --model /tmp/l8 $F --speculative-draft-model /tmp/l1b --speculative-num-tokens 4 \
          --max-running-requests 32 --batch 1 4 --input-len 512 --output-len 128 --out "$OUT/spec.json" ;;
    l8http) serve_model  # defaults (KV store on), a small file tier on this disk
        KV=${KV_DIR:-/tmp/kvstore}; rm -rf "$KV"; df -h /tmp | tail -1
        SF="$F --kv-store $KV --kv-store-disk-gb ${KV_DISK_GB:-24} --kv-drain-timeout ${KV_DRAIN_S:-60}"
        SF="$SF --kv-host-cache-gb ${HOST_GB:-2}"  # HOST_GB=32: the replay's prompts fit the host tier
        serve_start cold $SF && { http_bench l8_http_cold; serve_stop; }
        if [ "${REPLAY:-1}" = 1 ]; then  # REPLAY=0: the cold run only
          du -sh "$KV"; serve_start replay $SF && { serve_warmed; http_bench l8_http_replay; serve_stop; }
        fi
        rm -rf "$KV" ;;
    l8pd) serve_model  # one GPU, two replicas on half of it each: mixed (--replicas 2) against 1 prefill + 1 decode
        # (PD_GPR=1 on two GPUs: a GPU each, so neither side's kernels wait for the other's time slice)
        KV=${KV_DIR:-/tmp/kvstore}; PDWORK=${PD_WORK:-"--num-prompts 160 --input-len 2048 --output-len 256 --request-rate 8"}
        G="$F --gpus-per-rank ${PD_GPR:-0.5} --mem-fraction ${PD_MEM:-0.8} --kv-store $KV --kv-store-disk-gb 8"
        [ "${MPS:-0}" = 1 ] && mps_start  # MPS=1: the replicas' kernels share the GPU's SMs instead of taking time slices
        for mode in ${PD_MODES:-mixed pd}; do rm -rf "$KV"
          if [ "$mode" = mixed ]; then sides="--replicas 2${MIX_SM:+ --sm-percent $MIX_SM}"
          else sides="--prefill-replicas 1 --decode-replicas 1"  # PD_SM="P D": each side's SMs under MPS
            [ -n "${PD_SM:-}" ] && set -- $PD_SM && sides="$sides --prefill-sm-percent $1 --decode-sm-percent $2"; fi
          serve_start "$mode" $G $sides && { mps_clients; WORK="$PDWORK" http_bench "l8_pd_$mode"; serve_stop; }
          grep -E "^manta:pd_(transfer_(bytes|seconds|pages)|transfers)_total" "$OUT/l8_pd_${mode}_metrics.txt" | grep -v " 0.0"
          python3 -c "import json,sys; [print(r['name'], [{k: round(v, 3) for k, v in rk.items() if k.startswith('pd_') and v}
            for rk in ((r.get('stats') or {}).get('kvstore') or {}).get('ranks', [])]) for r in json.load(open(sys.argv[1]))['replicas']]" \
            "$OUT/l8_pd_${mode}_replicas.json"
        done; rm -rf "$KV"; [ "${MPS:-0}" = 1 ] && mps_stop ;;
    l8route) serve_model  # `manta bench routing` on the GPU: two replicas sharing it, the KV store on, caches that evict
        RS=${ROUTE_STORE:-/tmp/routestore}; rm -rf "$RS"
        RW=${ROUTE_WORK:-"--kv-cache-tokens 16384 --tree-max-tokens 1024 --conversations 64 --turns 6 --system-prompts 4
          --system-len 1024 --user-len 128 --output-len 64 --concurrency 16"}
        $M bench routing --model "$SERVE_MODEL" $F --gpus-per-rank 0.5 --mem-fraction ${PD_MEM:-0.8} \
          --kv-store "$RS" --kv-store-disk-gb 4 --kv-host-cache-gb ${ROUTE_HOST_GB:-8} $RW \
          --out "$OUT/l8_routing.json" 2>&1 | grep -v "INFO\|Warning"; rm -rf "$RS" ;;
    l8httpns) serve_model
        serve_start nostore $F --no-kv-store && { http_bench l8_http_nostore; serve_stop; } ;;
    l8httptp2) serve_model  # 2 GPUs: NCCL between Ray rank actors; the defaults (KV store on), as l8http's cold run
        KV=${KV_DIR:-/tmp/kvstore}; rm -rf "$KV"
        serve_start tp2 $F --tp 2 --kv-store $KV --kv-store-disk-gb ${KV_DISK_GB:-24} --kv-drain-timeout ${KV_DRAIN_S:-60} \
          && { http_bench l8_http_tp2; serve_stop; }
        rm -rf "$KV" ;;
    specid) build /tmp/l8 --preset llama-3.1-8b  # an agreeing, cheap draft: the target's first 2 layers
        $M bench spec --model /tmp/l8 $F --speculative-num-tokens 4 --identity-tail-layers 2 --identity-tail-only \
          --max-running-requests 32 --batch 1 4 16 --input-len 512 --output-len 128 --out "$OUT/spec_identity.json" ;;
  esac
done
