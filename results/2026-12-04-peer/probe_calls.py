"""Whole swap-in calls (CUDA graph, L2 flushed) with sharing on / off, A, B, C at batch 8 / 64, and A + 3 replays:
run against one tree (PYTHONPATH) and tagged; the caller interleaves trees."""
import sys, torch
from kvplan.benchmarks import swap_in as bs
from kvplan.kernels import hisparse as H
tag = sys.argv[1]
cases = [c.split(":") for c in (sys.argv[2] if len(sys.argv) > 2 else "A:single:8").split(",")]
dev = torch.device("cuda")
shape = bs.Shape(smoke=False)
clock = bs.Clock(dev, 8)
off = H.ResolveLaunch(shared_rows=False)
hosts = {}
for wl, kind, batch in cases:
    batch = int(batch)
    cache = "A" if wl == "A" else "B"
    if cache not in hosts:
        hosts.pop("A", None)
        hosts[cache] = bs.pinned_hosts(shape.host_rows[cache], 1 + bs.REPLAY_LAYERS, dev)
    if True:
        if True:
            w = bs.make_workload(wl, batch=batch, speculative=kind == "spec", calls=max(4, min(32, 256 // batch)),
                                 shape=shape, device=dev, seed=batch)
            b = bs.Bench(w, hosts[cache], clock)
            on = [b.call_us() for _ in range(3)]
            offs = [b.call_us(launch=off) for _ in range(3)] if wl != "A" else []
            b.call_us()
            line = f"[{tag}] {wl} {kind} b{batch}: on {min(on):.1f} (" + "/".join(f"{x:.1f}" for x in on) + ")"
            if offs:
                line += f" off {min(offs):.1f} (" + "/".join(f"{x:.1f}" for x in offs) + f") cost {min(on)/min(offs)-1:+.1%}"
            print(line, "|", bs.split_text(b.launch_split()), flush=True)
