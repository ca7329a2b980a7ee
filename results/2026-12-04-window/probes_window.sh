export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/ab/win
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_shared_host_rows.py tests/kernels/test_swap_in_multiprogram.py tests/gpu/test_swap_in_gpu.py 2>&1 | tail -3
for t in t0 win win4 win t0; do
  PYTHONPATH=$PWD/ab/$t timeout 100 python3 ab/probe_win.py $t C:single:8,C:spec:8,C:single:64,A:spec:64 2>&1 | grep "^\["
done
