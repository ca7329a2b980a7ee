export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_shared_host_rows.py tests/gpu/test_swap_in_gpu.py 2>&1 | tail -3
for t in t0 new new_noclaim new_earlycas new t0; do
  PYTHONPATH=$PWD/ab/$t timeout 100 python3 ab/probe_split.py $t C:single:8,C:spec:8,B:single:8,A:spec:8 2>&1 | grep "^\["
done
