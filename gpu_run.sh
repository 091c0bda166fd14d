#!/bin/bash
export PYTHONPATH=. PYTHONUNBUFFERED=1
echo "=== placement"
timeout 90 python3 -m pytest suites/engine/test_gpu_placement.py suites/harness/test_offload_placement.py -q -p no:cacheprovider -rfE > $OUT/placement.log 2>&1; echo rc=$?
grep -E "passed|failed|FAILED|^E  " $OUT/placement.log | head -12 | cut -c1-250
echo "=== perf 1b, 20 steps"
timeout 120 python3 -m harness perf --world-size 1 --engines builtin,torch-fsdp,torch-fsdp2 --strategies full_shard,shard_grad_op --steps 20 --warmup 3 > $OUT/perf1b.log 2>&1; echo rc=$?
grep -E "^\| |ratio|runs in" $OUT/perf1b.log | cut -c1-200
echo "=== whole suites, pairwise lane"
timeout 370 python3 -m pytest suites --matrix pairwise -n 8 -p no:cacheprovider -q -rfE > $OUT/pairwise.log 2>&1; echo rc=$?
grep -E "passed|failed|FAILED|ERROR|seed check|generated" $OUT/pairwise.log | tail -30 | cut -c1-250
