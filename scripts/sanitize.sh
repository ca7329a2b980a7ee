#!/usr/bin/env bash
# compute-sanitizer over a subset of the GPU tests that launches every kernel through every launch path:
#   swap-in resolve (single-step and speculative; int32 and int64 indices; with and without num_real_reqs; rows
#   spread over many programs, hash collisions, scratch and overflow), its fused plan copy and the copy_planned
#   launch (host rows past 2^31 bytes), pool launches and replay on a side stream, fused KV materialize (production
#   shapes, partial rotary, offsets past 2^31), the custom ops (opcheck), CUDA-graph capture and replay (also the
#   launch cache's graphs relaunched from several threads and streams), and the hostile-layout tests (every tensor
#   argument padded, permuted or expanded inside guard buffers; the request lifecycle's refusals).
#
# Usage, on the GPU machine from the repository root (each tool in its own call fits a 10-minute limit):
#   bash scripts/sanitize.sh memcheck     # memcheck, ~4-8 min
#   bash scripts/sanitize.sh racecheck    # racecheck (shared-memory hazards only), ~3-6 min
#   bash scripts/sanitize.sh              # both
#   bash scripts/sanitize.sh memcheck_hostile   # one run by its name (runs can go in parallel: one GPU holds them)
# The runs: memcheck_kernels, memcheck_hostile, memcheck_lifecycle, memcheck_multiprogram, memcheck_shared_rows,
# memcheck_epochs, memcheck_graphs, memcheck_fifth, racecheck_kernels, racecheck_multiprogram, the block-selection
# swap-in of K and V's memcheck_mha, memcheck_mha_graph and racecheck_mha, and the on-chip resolve's
# memcheck_onchip, racecheck_onchip, synccheck_onchip (scripts/h200_check.sh runs them side by
# side with the GPU suite, then the swap-in benchmark).
# Logs go to $OUT/sanitize/ (OUT defaults to ./out); one summary line per run is printed and kept in summary.txt.
# Exit status: 0 when every run reported 0 errors (0 hazards) and its tests passed, 1 otherwise, 2 without
# compute-sanitizer.
#
# memcheck runs the non-graph tests with PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is its own cudaMalloc, so an
# access past a tensor is an access past an allocation that memcheck reports (inside the caching allocator's blocks it
# could not see it). CUDA-graph capture needs the caching allocator, so the graph tests run in a second memcheck pass
# with it on. racecheck only checks shared memory (Triton's reductions, scans and sorts), so it gets the kernels
# once each at production shapes and the many-program swap-in cases.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-out}/sanitize"
mkdir -p "$OUT"
TOOLS="${1:-all}"
if ! command -v compute-sanitizer >/dev/null; then
  echo "sanitize: compute-sanitizer is not on PATH" >&2
  exit 2
fi
compute-sanitizer --version | tail -1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' ||
  exit 2

SWAP=tests/kernels/test_swap_in_gpu.py
MAT=tests/kernels/test_materialize_gpu.py
# production-shaped kernels, no graph capture
KERNELS=(
  "$SWAP::test_spec_production_shapes_equal_reference[1]"            # int64 indices, batch 1
  "$SWAP::test_spec_production_shapes_equal_reference[8]"            # int32 indices, num_real_reqs, a short row
  "$SWAP::test_single_step_production_shapes_equal_reference[1]"
  "$SWAP::test_spec_all_misses_scratch_and_overflow_at_production_shapes"
  "$SWAP::test_host_rows_past_2_31_bytes_copied_completely"          # copy_planned
  "$SWAP::test_identical_requests_read_each_host_row_once_at_production_shapes[8]"  # shared host rows, a replay
  "$MAT::test_production_shapes_with_int32_positions_on_the_cpu[1]"
  "$MAT::test_production_shapes_with_int32_positions_on_the_cpu[8192]"
  "$MAT::test_head_dims_dtypes_and_partial_rotary[80-48-dtype0]"     # partial rotary, head_dim not a power of 2
  "$MAT::test_pool_slab_views_with_offsets_past_2_31"                # pool.materialize
  "tests/pool/test_pool_graph_gpu.py::test_replay_on_a_side_stream_is_ordered_by_events"  # pool launches, side stream
  "tests/kernels/test_ops_gpu.py::test_opcheck_swap_in_at_production_shapes[spec]"
  "tests/kernels/test_ops_gpu.py::test_opcheck_copy_planned_and_materialize_at_production_shapes"
)
# every tensor argument in hostile layouts inside guard buffers, past its storage, plans of exactly their rows, the
# SGLang adapter's re-pointed tables; rows spread over many programs (the three paths); host rows shared, and copies given
# a garbage record of them. Left out:
# test_the_adapter_keeps_no_caller_tensor_alive checks Python references, not memory: under compute-sanitizer a plain
# Triton launch keeps its caller's frame (and so the caller's tensors) alive, outside Python's GC. It passes on the GPU
# without the sanitizer, in this file order too (results/README.md).
# (two runs, so each fits a 10-minute call beside the others)
HOSTILE=(tests/kernels/test_hostile_kernels.py tests/kernels/test_hostile_launch.py tests/compat/test_hostile_adapters.py
  tests/kernels/test_kernels_copy.py tests/kernels/test_hostile_views.py
  -k "not property and not keeps_no_caller_tensor_alive")
# the request lifecycle, rows over many programs (the three paths), shared host rows, and one workspace kept across
# calls (tables never cleared per call: stale entries of every other stamp, wraps, another layout over the storage):
# one run per file, so that run side by side each fits a 10-minute call
LIFECYCLE=(tests/state/test_hostile_lifecycle.py -k "not property")
MULTI=(tests/kernels/test_swap_in_multiprogram.py -k "not property")
SHARED_ROWS=(tests/kernels/test_shared_host_rows.py -k "not property")
EPOCHS=(tests/kernels/test_table_epochs.py -k "not property")
# the fifth hostile pass: padding rows on each copy path (batch 2, 6, 96) and in replays, the adapter from two threads on
# their own streams, plans tied to their requests, the checked mode's refusals before launching
FIFTH=(tests/kernels/test_hostile_fifth_gpu.py tests/kernels/test_hostile_padding_rows.py tests/pool/test_hostile_plan_ties.py
  tests/state/test_hostile_checks_fifth.py)
GRAPHS=(
  "$SWAP::test_cuda_graph_replays_with_new_inputs_and_allocates_nothing"
  "tests/pool/test_pool_graph_gpu.py::test_captured_pool_swap_in_and_replay_follow_new_inputs"
  "tests/pool/test_pool_gpu.py::test_reserve_capture_replay_through_the_pools_views"
  "$MAT::test_cuda_graph_replays_new_inputs_and_refreshed_weights"
  tests/kernels/test_relaunch_threads_gpu.py  # relaunches as CUDA graphs from several threads and streams at once
)
RACE_KERNELS=(
  "tests/kernels/test_hostile_fifth_gpu.py::test_a_padding_rid_copies_nothing_on_each_copy_path"  # the three copy paths
  "$SWAP::test_spec_production_shapes_equal_reference[1]"            # the flat copy
  "$SWAP::test_spec_production_shapes_equal_reference[8]"            # the sort, shared rows and the ordered copy
  "$SWAP::test_single_step_production_shapes_equal_reference[1]"
  "$SWAP::test_host_rows_past_2_31_bytes_copied_completely"
  "$MAT::test_production_shapes_with_int32_positions_on_the_cpu[8192]"
  "$MAT::test_head_dims_dtypes_and_partial_rotary[80-48-dtype0]"
)
RACE_MULTI=(tests/kernels/test_swap_in_multiprogram.py -k "rows_spanning or colliding")
# the on-chip resolve (CUDA C++, shared-memory tables, block and named barriers) forced: padding and short rows,
# every token a miss or a hit, duplicates, invalid tokens, broken LRU entries, guarded buffers, strided rows, production
# shapes, the flat copy taking each row as its block publishes it (its ready word)
ONCHIP=(tests/kernels/test_onchip_resolve.py -m gpu
  -k "(equals_reference and (mixed or all-miss or all-hit or duplicates or invalid) and (-6- or -40- or -3-)) or outside or strided or broken or production or (copy_per_row and (spec-2 or single-4))")
# the block-selection swap-in of K and V rows (docs/kernels.md §2a) on the GPU: production shapes (MiniMax M3's 16 blocks
# of 128 tokens, pinned caches), both resolves forced, hostile block ids inside guard buffers, the pool's launch and K+V
# replay in a CUDA graph (the caching allocator on: it captures), the SGLang adapter
MHA=(tests/kernels/test_swap_in_blocks.py tests/compat/test_compat_sglang_mha.py -m gpu -k "not cuda_graph")
MHA_GRAPH=("tests/kernels/test_swap_in_blocks.py::test_gpu_pool_swap_in_blocks_and_replay_in_a_cuda_graph")
RACE_MHA=(tests/kernels/test_swap_in_blocks.py -m gpu -k "production or hostile")
if ! python3 -c "import hypothesis" 2>/dev/null; then  # test_swap_in_multiprogram.py imports it
  echo "sanitize: hypothesis is not installed: the many-program swap-in cases are left out"
  HOSTILE=(tests/kernels/test_hostile_kernels.py)
  MULTI=()
  RACE_MULTI=(tests/kernels/test_hostile_kernels.py -k "honours_or_refuses and not permuted")
fi

status=0
# run NAME TOOL CACHING(0|1) pytest-args...
run() {
  local name=$1 tool=$2 caching=$3
  shift 3
  case "$TOOLS" in all | "$tool" | "$name") ;; *) return 0 ;; esac  # one tool, or one run by its name
  local log="$OUT/$name.log" started=$SECONDS
  local env=()
  [ "$caching" = 0 ] && env=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  # --report-api-errors no: cuda-bindings (the on-chip resolve's launcher) looks driver entry points up by version at
  # import, and a driver without the newest ones answers cuGetProcAddress_v2 with CUDA_ERROR_INVALID_VALUE (34 such
  # host-side reports per run on the H100's driver 580, none of them a kernel's); device errors are reported as before
  env ${env[@]+"${env[@]}"} compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 50 --error-exitcode 97 \
    python3 -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  local rc=$?
  local summary tests
  summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
  tests=$(grep -E "^=* *[0-9]+ (passed|failed|skipped|errors?|deselected).* in [0-9.]+s" "$log" | tail -1 |
    sed 's/=//g; s/^ *//; s/ *$//')
  local line="$name ($tool$([ "$caching" = 0 ] && echo ', no caching allocator')): ${summary:-no summary line} | pytest: ${tests:-no result} | exit $rc | $((SECONDS - started)) s"
  echo "$line" | tee -a "$OUT/summary.txt"
  case "$summary" in
    *"SUMMARY: 0 errors"* | *"SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"*) ;;
    *) status=1 ;;
  esac
  [ "$rc" = 0 ] || status=1
  case "$tests" in *passed*) ;; *) status=1 ;; esac  # nothing ran (e.g. no GPU: every test skipped) is no result
  case "$tests" in *failed* | *error*) status=1 ;; esac
}

run memcheck_kernels memcheck 0 "${KERNELS[@]}"
run memcheck_hostile memcheck 0 "${HOSTILE[@]}"
run memcheck_lifecycle memcheck 0 "${LIFECYCLE[@]}"
[ ${#MULTI[@]} -gt 0 ] && run memcheck_multiprogram memcheck 0 "${MULTI[@]}"
run memcheck_shared_rows memcheck 0 "${SHARED_ROWS[@]}"
run memcheck_epochs memcheck 0 "${EPOCHS[@]}"
run memcheck_graphs memcheck 1 "${GRAPHS[@]}"
run memcheck_fifth memcheck 0 "${FIFTH[@]}"
run memcheck_mha memcheck 0 "${MHA[@]}"
run memcheck_mha_graph memcheck 1 "${MHA_GRAPH[@]}"
run racecheck_mha racecheck 1 "${RACE_MHA[@]}"
run memcheck_onchip memcheck 0 "${ONCHIP[@]}"
run racecheck_onchip racecheck 1 "${ONCHIP[@]}"
run synccheck_onchip synccheck 1 "${ONCHIP[@]}"
run racecheck_kernels racecheck 1 "${RACE_KERNELS[@]}"
run racecheck_multiprogram racecheck 1 "${RACE_MULTI[@]}"
echo "sanitize: $([ "$status" = 0 ] && echo "all clean" || echo "FAILED (see $OUT/*.log)")"
exit "$status"
