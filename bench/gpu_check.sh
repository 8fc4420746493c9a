#!/usr/bin/env bash
# The GPU checks in one go, on a machine with an NVIDIA GPU (CI machines have none, so CI never runs this):
#   1. gsplat's CUDA kernels are built (JIT, once) while the CPU kernels compile beside them;
#   2. the CUDA tests (`pytest -m cuda`; the DVC whole-pipeline one only with RUN_PIPELINE=1: it needs the full
#      install with dvc and mlflow);
#   3. bench/gpu.py: default params on the 36-view 800x600 benchmark scene, with the CPU/CUDA steps/s ratio and a
#      profile of 40 steps (the GPU-busy share of a step);
#   4. with PEER_GSPLAT=<a gsplat checkout>: bench/gpu.py --peer-gsplat, splatflow against gsplat's
#      examples/simple_trainer.py on the same scene (PEER_SCENE=<undistorted COLMAP folder>, default the benchmark
#      scene), split and resolution (PEER_MAX_SIDE), PEER_STEPS steps for the peer (default 30000), run by
#      PEER_PYTHON (an environment with the checkout's examples/requirements.txt; it is checked before training);
#      PEER_SIDE=peer|ours measures one side (PEER_OTHER=<the other side's gpu_peer.json> joins them), so that the
#      peer's 30,000 steps and splatflow's run can go in two calls on the same GPU.
# Each phase has a time limit and its log is kept, so a failure in one leaves the others' figures.
#
#   bash bench/gpu_check.sh [OUTDIR]        (default bench/out/gpu; PYTHON=... picks the interpreter,
#                                            GPU_WORK=... the benchmark's scene folder, reused when prepared,
#                                            PHASES="build tests bench peer" which phases run ("kerneltests": the
#                                            Triton/torch kernels' CUDA tests alone, during the build), BENCH_ARGS=...
#                                            more bench/gpu.py arguments, PROFILE_AT=5210 the profiled step)
#
# On a GPU machine with no package registry, KIT=<folder written by bench/gpu_kit.py> installs what it lacks from
# that folder first (gsplat, pycolmap and the peer's packages into /tmp/splatflow_site, fused-ssim built there for
# its GPU) and sets PEER_GSPLAT, PEER_PYTHON and PEER_SCENE to the kit's checkout, interpreter and real scene.
#
# ARM=mcmc trains splatflow's side of the peer comparison with 3DGS-MCMC in gsplat's mcmc recipe (opacity 0.5 and
# scale 0.1 at the start, relocation and growth to the budget until 80 % of the steps), the candidate for the CUDA
# default: with PHASES=peer PEER_SIDE=ours PEER_PROFILE_AT=5210 one call measures it against the default plan's record.
set -uo pipefail
cd "$(dirname "$0")/.."
case ${ARM:-} in
  "") ;;
  mcmc) PEER_ARGS="${PEER_ARGS:-} --set densify.strategy=mcmc --set init_opacity=0.5 --set init_scale=0.1
        --set densify.refine_stop_fraction=0.8 --set prune_during.start_fraction=0.85
        --set prune_during.end_fraction=0.95";;
  *) echo "ARM=$ARM: unknown (mcmc, or unset for the default plan)"; exit 2;;
esac
out=${1:-bench/out/gpu}
mkdir -p "$out" && out=$(cd "$out" && pwd)
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
pyabs=$(command -v "$py" || echo "$py"); case $pyabs in /*) ;; *) pyabs=$PWD/$pyabs;; esac
if [ -n "${KIT:-}" ]; then
  kit=$(cd "$KIT" && pwd) || { echo "KIT=$KIT: no such folder; write it with bench/gpu_kit.py"; exit 2; }
  site=/tmp/splatflow_site
  mkdir -p "$site" && tar xJf "$kit/site.tar.xz" -C "$site" || { echo "$kit/site.tar.xz: could not unpack"; exit 2; }
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  # the peer's interpreter: the old pycolmap (SceneManager) and fused-ssim first, the placeholder AlexNet
  # checkpoint as its torch hub (its LPIPS is then discarded: --peer-drop-lpips)
  # fused-ssim is built outside the kit (a later call on the same machine finds it built: the kit is sent afresh)
  fssim=/tmp/splatflow_fused_ssim; [ -d "$fssim" ] || cp -r "$kit/fused-ssim" "$fssim"
  printf '#!/bin/sh\nPYTHONPATH="%s:%s:$PYTHONPATH" TORCH_HOME="%s" exec %s "$@"\n' \
    "$kit/peer-site" "$fssim" "$kit" "$pyabs" > /tmp/peer-python
  chmod +x /tmp/peer-python
  export PEER_GSPLAT=${PEER_GSPLAT:-$kit/gsplat} PEER_PYTHON=${PEER_PYTHON:-/tmp/peer-python}
  export PEER_SCENE=${PEER_SCENE:-$kit/scene} PEER_ARGS="${PEER_ARGS:-} --peer-drop-lpips"
fi
work=${GPU_WORK:-/tmp/splatflow_gpu_bench}
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1 SPLATFLOW_TRACKING=off
# the Triton Adam and loss kernels are opt-in until a GPU run has checked them: this script is that run
export SPLATFLOW_TRITON=${SPLATFLOW_TRITON:-1}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($py -c \
  "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo "")}
stamp() { date +%s; }
# pytest as every phase runs it: quiet, every outcome listed (-rA), no cache folder, the project's addopts off,
# within TEST_TIMEOUT seconds; the arguments pick the marks and files
run_pytest() { timeout ${TEST_TIMEOUT:-240} $py -m pytest -q -rA -p no:cacheprovider -o addopts="" "$@"; }
want() { case " ${PHASES:-build tests bench peer} " in *" $1 "*) return 0;; esac; return 1; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $py -c "import sys, torch, numpy, numba; print('python', sys.version.split()[0], '| torch', torch.__version__,
'cuda', torch.version.cuda, '| numpy', numpy.__version__, '| numba', numba.__version__)"
  command -v nvcc >/dev/null && nvcc --version | tail -2
  echo "cpus $(nproc), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS"
} 2>&1 | tee "$out/env.txt"

# 1. gsplat's kernels, and the CPU training step's kernels (numba, to its on-disk cache) compiled beside them
# (the build phase is needed by the others; on a machine that built them already it takes seconds)
(timeout 400 $py bench/train_step.py --cases 2K@240x135 --steps 3 --threads 4 > "$out/cpu_warmup.log" 2>&1) &
if [ -n "${KIT:-}" ]; then  # fused-ssim (one .cu file) for the peer, beside gsplat's build
  (t0=$(stamp); cd "$fssim" && { compgen -G "fused_ssim_cuda*.so" >/dev/null && echo "built already" ||
     timeout 400 "$pyabs" setup.py build_ext --inplace; } > "$out/fused_ssim_build.log" 2>&1
   echo "fused-ssim build: rc=$? in $(( $(stamp) - t0 )) s" >> "$out/summary.txt") &
fi
if want kerneltests; then  # the kernels that need no gsplat (Triton, torch), on the GPU beside gsplat's build
  # (the removal score's scan kernel, not yet used by default, is tested apart: its failure turns nothing off)
  (t0=$(stamp); run_pytest -m cuda -k "not scan_kernel" \
     tests/test_ssim.py tests/test_score_torch.py tests/test_score_triton.py tests/test_multi_adam.py \
     tests/test_ssim_triton.py > "$out/pytest_kernels_cuda.log" 2>&1
   krc=$?; echo "CUDA kernel tests: rc=$krc in $(( $(stamp) - t0 )) s: $(tail -1 "$out/pytest_kernels_cuda.log")" \
     >> "$out/summary.txt"; grep -E "removal cost on" "$out/pytest_kernels_cuda.log" >> "$out/summary.txt"
   [ $krc -eq 0 ] || touch "$out/.kernels_failed"
   run_pytest -m cuda -k scan_kernel tests/test_score_triton.py > "$out/pytest_scan_cuda.log" 2>&1
   echo "scan kernel's CUDA test: rc=$?: $(tail -1 "$out/pytest_scan_cuda.log")" >> "$out/summary.txt"
   grep -E "removal cost on" "$out/pytest_scan_cuda.log" >> "$out/summary.txt") &
fi
t=$(stamp)
timeout ${BUILD_TIMEOUT:-400} $py -c "from splatflow.pipeline.device import check_gsplat_cuda; check_gsplat_cuda()" \
  > "$out/gsplat_build.log" 2>&1
rc=$?
echo "gsplat kernels: rc=$rc in $(( $(stamp) - t )) s" | tee -a "$out/summary.txt"
tail -5 "$out/gsplat_build.log"
wait
cat "$out/cpu_warmup.log"
[ $rc -eq 0 ] || { echo "gsplat's kernels did not build: see $out/gsplat_build.log"; exit 1; }
if [ -e "$out/.kernels_failed" ]; then  # the benchmarks then time torch's own ops, not kernels that failed
  export SPLATFLOW_TRITON=0; rm -f "$out/.kernels_failed"
  echo "the Triton kernels failed their CUDA tests: the benchmarks run without them" | tee -a "$out/summary.txt"
fi

# 2. the CUDA tests
if want tests; then
sel="not whole_pipeline"; [ "${RUN_PIPELINE:-0}" = 1 ] && sel=""
t=$(stamp)
run_pytest -m cuda -k "$sel" \
  tests/test_device.py tests/test_render.py tests/test_ssim.py tests/test_score_torch.py \
  tests/test_score_triton.py tests/test_multi_adam.py tests/test_ssim_triton.py > "$out/pytest_cuda.log" 2>&1
echo "CUDA tests: rc=$? in $(( $(stamp) - t )) s: $(tail -1 "$out/pytest_cuda.log")" | tee -a "$out/summary.txt"
grep -E "removal cost on" "$out/pytest_cuda.log" | tee -a "$out/summary.txt"
# the same kernels on CPU tensors under Triton's interpreter (what CPU machines with Triton check)
t=$(stamp)
run_pytest -m "not cuda" \
  tests/test_score_torch.py tests/test_score_triton.py tests/test_multi_adam.py tests/test_ssim_triton.py \
  > "$out/pytest_kernels.log" 2>&1
echo "kernel tests (CPU tensors): rc=$? in $(( $(stamp) - t )) s: $(tail -1 "$out/pytest_kernels.log")" \
  | tee -a "$out/summary.txt"
grep -E "PASS|FAIL|ERROR|SKIP" "$out/pytest_cuda.log" | tail -16
fi

# 3. the benchmark
if want bench; then
t=$(stamp)
timeout ${BENCH_TIMEOUT:-300} $py bench/gpu.py --work "$work" --json "$out/gpu.json" --compare-cpu \
  --threads "$(nproc)" --profile-at "${PROFILE_AT:-5210}" ${BENCH_ARGS:-} > "$out/gpu_bench.log" 2>&1
echo "bench/gpu.py: rc=$? in $(( $(stamp) - t )) s" | tee -a "$out/summary.txt"
grep -v "it/s\]$" "$out/gpu_bench.log" | tail -45
fi

# 4. splatflow against gsplat's simple_trainer (only with a checkout to run)
if want peer; then
if [ -z "${PEER_GSPLAT:-}" ]; then
  echo "peer comparison: skipped (set PEER_GSPLAT to a gsplat checkout)" | tee -a "$out/summary.txt"
else
t=$(stamp)
limit=$(( ${PEER_TIMEOUT:-420} + ${OURS_TIMEOUT:-300} ))
timeout $limit $py bench/gpu.py --deadline $(( limit - 10 )) --work "$work" --json "$out/gpu_peer.json" --peer-only \
  --peer-gsplat "$PEER_GSPLAT" --peer-python "${PEER_PYTHON:-$py}" ${PEER_SCENE:+--scene "$PEER_SCENE"} \
  ${PEER_MAX_SIDE:+--max-side "$PEER_MAX_SIDE"} --peer-steps "${PEER_STEPS:-30000}" \
  --peer-timeout "${PEER_TIMEOUT:-420}" ${PEER_PROFILE_AT:+--profile-at "$PEER_PROFILE_AT"} ${PEER_ARGS:-} \
  ${PEER_SIDE:+--side "$PEER_SIDE"} ${PEER_OTHER:+--other-json "$PEER_OTHER"} \
  > "$out/gpu_peer.log" 2>&1
echo "bench/gpu.py --peer-gsplat: rc=$? in $(( $(stamp) - t )) s" | tee -a "$out/summary.txt"
grep -v "it/s\]$" "$out/gpu_peer.log" | tail -40
fi
fi
cat "$out/summary.txt"
