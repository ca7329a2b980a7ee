export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_shared_host_rows.py -k "one_launch or colliding" 2>&1 | tail -3
for t in t0 noclaim nospan both t0; do
  PYTHONPATH=$PWD/ab/$t timeout 120 python3 ab/probe_split.py $t C:single:8,C:spec:8,B:single:8 2>&1 | grep "^\["
done
