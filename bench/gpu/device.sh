#!/usr/bin/env bash
# Issue 31 on a GPU machine, in one command (a session has 15 minutes of device time; nothing can be downloaded
# there). Here first:  bash bench/gpu/pack.sh   then the device tool:
#   run(command="bash bench/gpu/device.sh", carry=[".gpu"], timeout_s=590)
#
# 1. builds the vendored llama.cpp once with CUDA (shared libraries for llama-cpp-python's package, and llama-server
#    from the same tree), with kvroute's build rule (common/build.py) plus -DGGML_CUDA=on for this one chip;
#    (or unpacks the build an earlier session made, carried in .gpu/build/);
# 2. then, in order of importance, each stage in its own log and cut at the deadline: which context settings the
#    build survives (bench.gpu.context_probe, with native stacks), and the flags of the first worker-shaped context
#    that lived, which every kvroute run after it takes; bench.gpu.smoke (`kvroute serve` on the GPU); the first
#    crash again under cuda-gdb; llama.cpp alone (llama-batched-bench); throughput at 32/8/64 concurrent vs
#    llama-server; the worker tests on the GPU; the engine's time outside llama_decode; the agent workloads; the
#    long session;
#    GPU_ONLY=REGEX runs only the stages it matches (and the build, a no-op on a machine that still has it);
# 3. everything lands in $OUT/results.tgz (rewritten after every stage, so a cut run still returns what it did),
#    and the built libraries in $OUT/build-* (xz pieces): carried back in .gpu/build/, they replace the build.
set -u
T0=$(date +%s)
DEADLINE=$((T0 + ${GPU_SECONDS:-565}))
OUT=${OUT:-/tmp/gpu-out}
RES=/tmp/gpu-res
mkdir -p "$OUT" "$RES"
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$RES/summary.txt"; }
save() { tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null; }
stage() { # stage NAME SECONDS CMD...: output in $RES/NAME.log; stopped after SECONDS or at the deadline
  local name=$1 secs=$2 left rc
  shift 2
  if [ -n "${GPU_ONLY:-}" ] && [ "$name" != build ] && ! [[ $name =~ $GPU_ONLY ]]; then return 0; fi # a rerun's choice
  left=$((DEADLINE - $(date +%s) - 3))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 20 ]; then
    log "SKIP $name: no time left"
    return 1
  fi
  log "start $name (at most ${secs}s)"
  timeout -k 5 "$secs" "$@" >"$RES/$name.log" 2>&1
  rc=$?
  log "end $name: exit $rc"
  tail -n "${TAIL:-8}" "$RES/$name.log"
  save
  return $rc
}

export PYTHONUNBUFFERED=1 KVROUTE_CACHE=/tmp/kvroute-cache
{ nvidia-smi; nvcc --version; grep -m1 "model name" /proc/cpuinfo; nproc; free -g; python3 -V; cmake --version; } >"$RES/machine.txt" 2>&1
grep -E "Driver Version|H100|H200|release" "$RES/machine.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD
export KVROUTE_MODEL=/tmp/model.gguf
python3 -m bench.gpu.shaped_model --unpack .gpu/model.gguf.xz "$KVROUTE_MODEL" &
MODEL_READY=$!
cc -shared -fPIC -O1 -o /tmp/segv_trace.so bench/gpu/segv_trace.c || log "segv_trace: not built (no native stacks)"

# --- 1. build
FLAGS=$(python3 -c "from bench.llama_server import CMAKE_FLAGS; print(' '.join(CMAKE_FLAGS))")
eval "$(CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" python3 -c "
import shlex
from common.build import this_machine
r = this_machine()
print('RULE=' + shlex.quote(r.cmake_args))
print('export CFLAGS=' + shlex.quote(r.cflags) + ' CXXFLAGS=' + shlex.quote(r.cxxflags))
for n in r.notes: print('echo ' + shlex.quote('build rule: ' + n))
")"
log "cmake flags: $FLAGS -DBUILD_SHARED_LIBS=ON -DGGML_CUDA_NCCL=OFF $RULE; CFLAGS=$CFLAGS"
if ls .gpu/build/* >/dev/null 2>&1; then # an earlier session's build, carried (bench/gpu/pack.sh)
  mkdir -p /tmp/b/bin && cat .gpu/build/* | xz -d | tar xf - -C /tmp/b/bin && log "build: carried, not rebuilt"
fi
if [ ! -x /tmp/b/bin/llama-server ]; then
  TAIL=3 stage build 480 bash -c "cmake -S .gpu/llama.cpp -B /tmp/b -G Ninja $FLAGS -DBUILD_SHARED_LIBS=ON \
    -DGGML_CUDA_NCCL=OFF $RULE && cmake --build /tmp/b --target llama mtmd llama-server llama-batched-bench -j $(nproc)"
  # kept for a later session, which carries it in .gpu/build/ and skips the build (a few minutes of its 15)
  (cd /tmp/b/bin && tar cf - *.so* llama-server llama-batched-bench | nice -n 19 xz -T8 -9e | split -b 15M - "$OUT/build-") &
fi
wait $MODEL_READY
if [ ! -x /tmp/b/bin/llama-server ] || [ ! -f /tmp/b/bin/libggml-cuda.so ]; then
  log "build failed: see build.log"
  save
  exit 1
fi
mkdir -p .gpu/site/llama_cpp/lib && cp -a /tmp/b/bin/*.so* .gpu/site/llama_cpp/lib/ # as an installed wheel has it
export KVROUTE_LLAMA_SERVER=/tmp/b/bin/llama-server
# every process from here on prints its native stack if it crashes (bench/gpu/segv_trace.c)
[ -f /tmp/segv_trace.so ] && export LD_PRELOAD=/tmp/segv_trace.so

# --- 2. the GPU path
TAIL=60 stage context-probe 150 python3 -m bench.gpu.context_probe --gpu 0 --preload /tmp/segv_trace.so \
  --failed-out "$RES/failed-case.json"
# the first worker-shaped context that lived gives the flags of every kvroute run after it ("" = the defaults)
KVFLAGS=$(sed -n 's/^PICK: //p' "$RES/context-probe.log" | tail -1)
case $KVFLAGS in "(defaults)" | none | "") KVFLAGS="" ;; esac
log "kvroute flags for the runs below: '${KVFLAGS}'"
TAIL=40 stage smoke 100 python3 -m bench.gpu.smoke --gpu 0 --kvroute-flags "$KVFLAGS"
if [ -f "$RES/failed-case.json" ] && command -v cuda-gdb >/dev/null; then # the native stack with gdb's names
  mapfile -t ARGV < <(python3 -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))))' "$RES/failed-case.json")
  TAIL=40 stage gdb 75 env KVROUTE_LLAMA_VERBOSE=1 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt \
    -ex "info threads" --args "${ARGV[@]}"
fi
TAIL=12 stage llama-alone 60 /tmp/b/bin/llama-batched-bench -m "$KVROUTE_MODEL" -c 32768 -b 2048 -ub 512 \
  -npp 200 -ntg 256 -npl 8,32,64 -ngl 99 -fa auto
# one wave of n requests per repeat (2026-11-28: llama-server alone took 48 s for two waves of 64, so a stage of 90 s
# cut it before kvroute's turn); the stage's seconds by n
for n_s in 32:110 8:60 64:150; do
  n=${n_s%:*}
  TAIL=6 stage "throughput-$n" "${n_s#*:}" python3 -m bench.run --gpu 0 --threads 8 --workloads throughput \
    --systems kvroute,llama-server --slots "$n" --concurrency "$n" --requests "$n" --throughput-max-tokens 256 \
    --repeats 2 --kvroute-flags "$KVFLAGS" --out "$RES/throughput-$n"
done
TAIL=15 stage worker-tests 120 env KVROUTE_GPU=0 python3 -m pytest tests/worker -m model -q -p no:cacheprovider -p bench.gpu.first_load --continue-on-collection-errors \
  --timeout 60
TAIL=6 stage engine-64 60 python3 bench/worker_bench.py --gpu 0 --slots 64 --gen 128 --repeats 1
TAIL=10 stage agents 120 python3 -m bench.run --gpu 0 --threads 8 --workloads agent-long,many-agents,fanout \
  --systems kvroute,llama-server --repeats 1 --kvroute-flags "$KVFLAGS" --out "$RES/agents"
TAIL=10 stage long-session 120 python3 -m bench.run --gpu 0 --threads 8 --workloads long-session \
  --systems kvroute,llama-server --repeats 1 --kvroute-flags "$KVFLAGS" --out "$RES/long-session"

wait
save
log "done: $(ls "$OUT")"
