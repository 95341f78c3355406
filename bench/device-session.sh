#!/usr/bin/env bash
# One prepared call per part for a GPU machine of 16 cores without Node (issues 36 and 37): each
# part fits one 600 s command and writes everything under $OUT (default: bench/results/device).
#
# Here, before the device call:
#   npm ci && npm run build && ../shared/tools/device-bundle
# Then on the device machine, from the checkout's root, with .device-bundle carried:
#   source .device-bundle/setup.sh && bash bench/device-session.sh gpu   # about 560 s
#   source .device-bundle/setup.sh && bash bench/device-session.sh cpu   # about 540 s
#   source .device-bundle/setup.sh && bash bench/device-session.sh bars  # about 400 s
# (setup.sh unpacks Node, dist/ and the native addon into /tmp/lw and puts Node on PATH.)
#
# gpu: the machine's CPU and GPU; `bench gpu` (issue 36's table, PyTorch beside it where
#      importable); both models' GPU ms by kernel (summary.json gpu_kernels), and both with
#      the captured step (layerwise only); `bench matmul-tiles`;
#      traced runs of both models with the captured step (`--trace`: each action's host and
#      GPU spans, the gaps between steps).
# cpu: `bench cores` (single fp32/bf16 at the default threads against PyTorch on all cores,
#      zbv K=3, the rest as the budget allows); `bench kernels` at 4, 8, 14, 16 threads in fp32
#      (by input shapes) and bf16, after 20 warm-up rounds (V8 optimizes the step's JS for tens
#      of steps); bf16 at 16 threads by shapes with the split over k's old bound and the new
#      (split-bound-65536/, split-bound-1048576/: their weight-gradient rows).
# bars: only the issues' bars, so that a 15-minute lease holds it and a second call: both
#      models on webgpu (captured, and charlm-small not captured) with PyTorch beside them
#      (gpu.md), and single fp32/bf16 at 16 and the default threads with PyTorch, zbv K=3 at its
#      default threads (cores.md), zbv K=3 at M=4 beside its M=8 (cores-zbv-m4.md), and single
#      and zbv K=3 without the native captured step (cores-uncaptured.md), the kernels at a zbv
#      device's micro-batch and threads (microbatch-4/, microbatch-32/), and zbv K=3 trained with
#      three splits of the threads among its devices (zbv3-threads-*/summary.json).
set -u
part=${1:-}
if [ "$part" != gpu ] && [ "$part" != cpu ] && [ "$part" != bars ]; then
  echo "device-session: give the part to run, gpu, cpu or bars (see this file's header)" >&2
  exit 2
fi
here=$(pwd)
out=${OUT:-$here/bench/results/device}
lw=${LAYERWISE_ROOT:-/tmp/lw}
mkdir -p "$out"
if [ ! -f "$lw/dist/bench/main.js" ]; then
  echo "device-session: no $lw/dist/bench/main.js: source .device-bundle/setup.sh first (see this file's header)" >&2
  exit 2
fi
bench() { node "$lw/dist/bench/main.js" "$@" --out "$out"; }
{ lscpu; echo; nproc; } >"$out/lscpu.txt" 2>&1
case "$part" in
  gpu)
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1
    bench gpu --budget-seconds 220
    # where each model's GPU time goes, by kernel (LAYERWISE_WEBGPU_KERNEL_TIMES=1: every
    # dispatch in a timed pass of its own; summary.json gpu_kernels), in place of last session's
    # whole-model A/B of the 64 x 64 tiling (matmul-tiles below times every tiling per product)
    small='--preset charlm-small'
    large='--preset charlm-small --layers 8 --d-model 1024 --heads 16 --context 256'
    for m in small large; do
      if [ $m = small ]; then shape=$small; limit=40; else shape=$large; limit=50; fi
      # shellcheck disable=SC2086
      LAYERWISE_WEBGPU_KERNEL_TIMES=1 timeout $limit node "$lw/dist/cli/main.js" train $shape --strategy single \
        --backend webgpu --batch-size 32 --steps 6 --eval-every 0 --eval-batches 1 \
        --out "$out/kernel-times-$m" >"$out/kernel-times-$m.txt" 2>&1
    done
    # Dawn without its shaders' index clamps (robustness): on an H100 charlm-small ran 210,396 ->
    # 249,869 tokens/s and the 8 x d1024 model 32,165 -> 38,361 with it off; and with the clamps
    # kept only where an index may be out of range (integer range analysis)
    for f in disable_robustness enable_integer_range_analysis_in_robustness; do
      LAYERWISE_DAWN_FLAGS=enable-dawn-features=$f bench gpu --configs small/layerwise,large/layerwise \
        --config-seconds 45 --name "gpu-$f"
    done
    timeout 40 node "$lw/dist/bench/main.js" matmul-tiles --out "$out"
    # where a captured step's time goes on the GPU machine (captured by default): each action's host and GPU spans
    # and the gaps between steps (summary.json beside it: host ms and GPU busy per step); the
    # large model was 70% busy uncaptured (bench/results/gpu-h200-2026-11-26.md): are its idle 30% the two reads
    # a step (the loss, the gradient norm) or the host?
    for m in small large; do
      if [ $m = small ]; then shape=$small; steps=22; limit=50; else shape=$large; steps=8; limit=45; fi
      # shellcheck disable=SC2086
      timeout $limit node "$lw/dist/cli/main.js" train $shape --strategy single \
        --backend webgpu --batch-size 32 --steps $steps --eval-every 0 --eval-batches 1 \
        --out "$out/$m-trace" --trace "$out/$m-trace/trace.json" >"$out/$m-trace.txt" 2>&1
    done
    ;;
  cpu)
    bench cores --pytorch-script "$here/bench/pytorch/charlm.py" --budget-s 230
    # fp32 by input shapes: which products scale (a dense layer's dy W^T now runs on W
    # transposed first, native/src/matmul.cc transposesWeight; its weight gradients' k split,
    # splitsReduction, was tuned at 2 threads)
    # --replay: the same step's addon calls alone at each count, the ceiling of a captured
    # native step (on 2 cores the TF.js step took 1.09-1.38x the replay's time at 2 threads)
    bench kernels --threads 4,8,14,16 --steps 5 --warmup 20 --precision fp32 --shapes --replay
    bench kernels --threads 4,8,14,16 --steps 5 --warmup 20 --precision bf16 --replay
    # the weight gradients' split over k up to 2^20 output elements (raised from 2^16 on a Zen 5
    # at 2 threads) against the old bound at 16 threads, by shapes: keep whichever is faster here
    for bound in 65536 1048576; do
      LAYERWISE_SPLIT_REDUCTION_MAX=$bound node "$lw/dist/bench/main.js" kernels --threads 16 --steps 5 \
        --warmup 20 --precision bf16 --shapes --out "$out/split-bound-$bound"
    done
    # long products split over rows (native/src/matmul.cc splitRows, 256 rows a member; tuned at
    # 2 threads) against oneDNN's own split (0: never) at 16 threads
    for min in 0 256; do
      LAYERWISE_SPLIT_ROWS_MIN=$min node "$lw/dist/bench/main.js" kernels --threads 16 --steps 5 \
        --warmup 20 --precision fp32 --shapes --out "$out/split-rows-$min"
    done
    ;;
  bars)
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1
    bench gpu --budget-seconds 150 --configs small/layerwise,small/uncaptured,small/pytorch-fp32,small/pytorch-sdpa,large/layerwise,large/pytorch-fp32,large/pytorch-sdpa,large/pytorch-sdpa-bf16
    bench cores --pytorch-script "$here/bench/pytorch/charlm.py" --kinds single,single-bf16,zbv --stages 3 \
      --threads 16 --micro-batches 8 --warmup 10 --budget-s 90
    # zbv K=3 with fewer, larger micro-batches (issue 37: at M=8 each device's 512-row products
    # and element-wise passes are too small for its 5 threads; M=4 gives 1,024 rows)
    bench cores --python '' --kinds zbv --stages 3 --threads 16 --micro-batches 4 --warmup 10 \
      --budget-s 45 --name cores-zbv-m4
    # single and zbv K=3 without the native captured step (pipeline/native-capture.ts, on by
    # default; pipeline stages capture since 0915616), beside the captured rows above: what the
    # step's JS between kernels costs at 16 threads (on 2 cores, 1 thread a device, zbv K=3 gained
    # 3% from it, zbv K=2 25%: bench/results/cores-2-cores-local-zbv3*.md)
    LAYERWISE_NATIVE_CAPTURE=0 bench cores --python '' --kinds single,single-bf16,zbv --stages 3 \
      --threads 16 --micro-batches 8 --warmup 10 --budget-s 70 --name cores-uncaptured
    # which kernels stop scaling at a zbv device's micro-batch (batch 32 / M 8 = 4 sequences, 512
    # rows) on 7 threads (the default split of 16 cores gives zbv K=3 1 / 7 / 6), against the
    # whole batch on 7: each kernel's speedup from 1 to 7 threads by input shapes (on 2 cores,
    # 1 -> 2 threads, every kernel over 1 ms scaled 1.66-1.97x at batch 4, medians:
    # bench/results/kernels-native-microbatch-2-cores.md)
    for b in 4 32; do
      timeout 60 node "$lw/dist/bench/main.js" kernels --batch-size $b --threads 1,7 --steps 5 --warmup 20 \
        --shapes --out "$out/microbatch-$b"
    done
    # zbv K=3's kernel threads per device: the default split by FLOPs (16 cores: 1 / 7 / 6, whose
    # two busy devices have equal loads, so the one with 6 sets the pace), 1 / 6 / 6 (the same
    # pace, one core more for the host) and 1 / 7 / 7 (the host's second core to the busy
    # devices: 14,659 tokens/s on an H100 host before the captured step, with re-materialization)
    for split in default 1,6,6 1,7,7; do
      devs=()
      [ "$split" = default ] || devs=(--devices "$(echo "$split" | sed -E 's/([0-9]+)/thread:threads=\1/g')")
      timeout 90 node "$lw/dist/cli/main.js" train --preset charlm-small --backend native --batch-size 32 \
        --steps 14 --eval-every 0 --eval-batches 1 --strategy gpipe --schedule zbv --stages 3 --micro-batches 8 \
        --checkpoint never ${devs[@]+"${devs[@]}"} --out "$out/zbv3-threads-$split" >"$out/zbv3-threads-$split.txt" 2>&1
    done
    ;;
esac
ls -l "$out"
