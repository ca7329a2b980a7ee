"""Sharing on / off for whole calls (graph, L2 flushed) and the eager per-launch split of both."""
import sys, torch
from kvplan.benchmarks import swap_in as bs
from kvplan.kernels import hisparse as H
tag = sys.argv[1]
cases = [c.split(":") for c in sys.argv[2].split(",")]
dev = torch.device("cuda")
shape = bs.Shape(smoke=False)
clock = bs.Clock(dev, 8)
off = H.ResolveLaunch(shared_rows=False)
hosts = {}
for wl, kind, batch in cases:
    batch = int(batch)
    cache = "A" if wl == "A" else "B"
    if cache not in hosts:
        hosts.clear()
        hosts[cache] = bs.pinned_hosts(shape.host_rows[cache], 1 + bs.REPLAY_LAYERS, dev)
    w = bs.make_workload(wl, batch=batch, speculative=kind == "spec", calls=max(4, min(32, 256 // batch)),
                         shape=shape, device=dev, seed=batch)
    b = bs.Bench(w, hosts[cache], clock)
    on, offs = [], []
    for _ in range(3):
        on.append(b.call_us()); offs.append(b.call_us(launch=off))
    b.call_us()
    line = f"[{tag}] {wl} {kind} b{batch}: on {min(on):.1f} (" + "/".join(f"{x:.1f}" for x in on) + ")"
    line += f" off {min(offs):.1f} (" + "/".join(f"{x:.1f}" for x in offs) + f") cost {min(on)/min(offs)-1:+.1%}"
    print(line, flush=True)
    print(f"[{tag}]    on  |", bs.split_text(b.launch_split()), flush=True)
    print(f"[{tag}]    off |", bs.split_text(b.launch_split(launch=off)), flush=True)
