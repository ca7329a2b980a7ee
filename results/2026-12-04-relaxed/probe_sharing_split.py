import torch, sys
from kvplan.benchmarks import swap_in as bs
from kvplan.kernels import hisparse as H
dev = torch.device("cuda")
shape = bs.Shape(smoke=False)
clock = bs.Clock(dev, 8)
hosts = bs.pinned_hosts(shape.host_rows["B"], 1 + bs.REPLAY_LAYERS, dev)
off = H.ResolveLaunch(shared_rows=False)
for wl in ("C", "B"):
    for kind in ("single", "spec"):
        for batch in (8, 16, 64):
            w = bs.make_workload(wl, batch=batch, speculative=kind == "spec", calls=max(4, min(32, 256 // batch)), shape=shape, device=dev, seed=batch)
            b = bs.Bench(w, hosts, clock)
            on_us = b.call_us(); off_us = b.call_us(launch=off)
            on_res = b.call_us(copy=False); off_res = b.call_us(launch=off, copy=False)
            b.call_us()
            s_on = b.launch_split(); s_off = b.launch_split(launch=off)
            print(f"{wl} {kind} b{batch}: on {on_us:.1f} off {off_us:.1f} ({on_us/off_us-1:+.1%}) | resolve on {on_res:.1f} off {off_res:.1f} | rows {b.plan_rows():.0f}")
            print("   on :", bs.split_text(s_on)); print("   off:", bs.split_text(s_off), flush=True)
