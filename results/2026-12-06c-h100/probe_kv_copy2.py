"""Probe: why the K+V plan copy of the block (MHA) swap-in reaches ~0.52 of the link on P at batch 64 while the MLA
single-step call's own copy of the same layout reaches ~0.89. Same plans, copied in variants:
K+V (as shipped); K only; V only; K then V (two launches); K+V with V read from the K cache (one host region:
tests the translation working-set hypothesis); and the MLA single-step workload's call and replay for comparison.
Run on the GPU from the repository root: python results/2026-12-06c-h100/probe_kv_copy2.py"""

import torch

from kvplan.benchmarks import swap_in as b
from kvplan.kernels import copy as copy_module

device = torch.device("cuda")
shape = b.Shape(False)
clock = b.Clock(device, 10)
hosts = b.pinned_hosts(shape.host_rows["B"], 1 + b.REPLAY_LAYERS, device)
ceiling = b.ceiling_gbps(hosts[0], device, 10)
print(f"ceiling {ceiling:.1f} GB/s", flush=True)
batch = 64


def rate(rows, us, kv):
    gbps = rows * kv * b.ITEM / (us * 1e3)
    return f"{us:8.1f} us {gbps:6.1f} GB/s {gbps / ceiling:5.2f} of link"


# the MLA single-step workload, same layout
w = b.make_workload("P", batch=batch, speculative=False, calls=4, shape=shape, device=device, seed=batch)
mla = b.Bench(w, hosts, clock)
print(f"MLA single batch {batch}: call {mla.call_us():.1f} us; {mla.decision()}", flush=True)
print("  launches:", b.split_text(mla.launch_split()), flush=True)
mla.call_us()
rows = mla.plan_rows()
print(f"  plan rows {rows}; replay (miss order walk) {rate(rows, mla.copy_us(), 1)}", flush=True)

w = b.make_mha_workload("P", batch=batch, calls=4, shape=shape, device=device, seed=batch)
mha = b.Bench(w, hosts, clock)
print(f"MHA batch {batch}: call {mha.call_us():.1f} us; {mha.decision()}", flush=True)
print("  launches:", b.split_text(mha.launch_split()), flush=True)
mha.call_us()
rows = mha.plan_rows()
dbuf = w["device_buffers"]


def timed(fn):
    return clock.time_ms(lambda: [fn(c) for c in range(mha.calls)]) * 1e3 / mha.calls


def copy(c, host, dev, host_v=None, dev_v=None, ws=True, launch=None):
    copy_module.run_copy(mha.miss_plans[c], host, dev, num_real_reqs=mha.num_real, counters=mha.counters,
                         workspace=mha.workspaces[c] if ws else None, host_cache_v=host_v, device_buffer_v=dev_v,
                         launch=launch)


print(f"  plan rows {rows}", flush=True)
print("  K+V (shipped replay)        ", rate(rows, timed(lambda c: copy(c, hosts[0], dbuf[0], hosts[1], dbuf[1])), 2))
print("  K+V no workspace            ", rate(rows, timed(lambda c: copy(c, hosts[0], dbuf[0], hosts[1], dbuf[1], ws=False)), 2))
print("  K only                      ", rate(rows, timed(lambda c: copy(c, hosts[0], dbuf[0])), 1))
print("  V only                      ", rate(rows, timed(lambda c: copy(c, hosts[1], dbuf[1])), 1))
print("  K then V (two launches)     ", rate(rows, timed(lambda c: (copy(c, hosts[0], dbuf[0]), copy(c, hosts[1], dbuf[1]))), 2))
print("  K+V, V from the K cache     ", rate(rows, timed(lambda c: copy(c, hosts[0], dbuf[0], hosts[0], dbuf[1])), 2))
print("  K+V, V from cache 3         ", rate(rows, timed(lambda c: copy(c, hosts[0], dbuf[0], hosts[3], dbuf[1])), 2))
# the plan's walk order: are a request's entries sorted by host row?
plan = mha.miss_plans[0]
cnt = plan.count[:batch].tolist()
srt = sum(bool((plan.src[r, : cnt[r]].diff() >= 0).all()) for r in range(batch))
print(f"  plan rows sorted by host row: {srt} of {batch}; entries per row {min(cnt)}-{max(cnt)}", flush=True)
# sort the plan rows by host row (what a sorted walk would see) and copy again
order = plan.src[:batch].argsort(dim=1)
s_src = torch.gather(plan.src[:batch], 1, order)
s_dst = torch.gather(plan.dst[:batch], 1, order)
col = torch.arange(plan.src.shape[1], device=device)[None, :]
valid = col < plan.count[:batch, None]
big = torch.iinfo(torch.int64).max
key = torch.where(valid, plan.src[:batch], big)
order = key.argsort(dim=1)
s_src = torch.gather(plan.src[:batch], 1, order).contiguous()
s_dst = torch.gather(plan.dst[:batch], 1, order).contiguous()
from kvplan.plan import MissPlan
sorted_plan = MissPlan(s_src, s_dst, plan.count[:batch].clone())


def copy_sorted(c, host, dev, host_v=None, dev_v=None, launch=None):
    copy_module.run_copy(sorted_plan, host, dev, num_real_reqs=mha.num_real, counters=mha.counters,
                         host_cache_v=host_v, device_buffer_v=dev_v, launch=launch)


print("  sorted plan K+V             ", rate(rows, timed(lambda c: copy_sorted(c, hosts[0], dbuf[0], hosts[1], dbuf[1])), 2))
print("  sorted plan K only          ", rate(rows, timed(lambda c: copy_sorted(c, hosts[0], dbuf[0])), 1))
print("  sorted plan K then V        ", rate(rows, timed(lambda c: (copy_sorted(c, hosts[0], dbuf[0]), copy_sorted(c, hosts[1], dbuf[1]))), 2))
for rp, ps, nw in ((4, 2, 1), (4, 4, 1), (8, 2, 1), (2, 4, 1), (4, 8, 1), (16, 1, 4)):
    L = copy_module.CopyLaunch(rows_per_program=rp, programs_per_sm=ps, num_warps=nw)
    print(f"  sorted plan K+V {L}", rate(rows, timed(lambda c: copy_sorted(c, hosts[0], dbuf[0], hosts[1], dbuf[1], launch=L)), 2), flush=True)
    print(f"  sorted plan K   {L}", rate(rows, timed(lambda c: copy_sorted(c, hosts[0], dbuf[0], launch=L)), 1), flush=True)
