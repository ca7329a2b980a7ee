import torch, sys, kvplan
print("tree:", kvplan.__file__, flush=True)
from kvplan.benchmarks import swap_in as bs
from kvplan.kernels import hisparse as H
dev = torch.device("cuda")
shape = bs.Shape(smoke=False)
clock = bs.Clock(dev, 8)
hosts = bs.pinned_hosts(shape.host_rows["B"], 1 + bs.REPLAY_LAYERS, dev)
off = H.ResolveLaunch(shared_rows=False)
for wl, kind, batch in [("C","single",8),("C","spec",8),("C","spec",64),("B","single",8),("B","spec",8),("B","spec",64)]:
    w = bs.make_workload(wl, batch=batch, speculative=kind == "spec", calls=max(4, min(32, 256 // batch)), shape=shape, device=dev, seed=batch)
    b = bs.Bench(w, hosts, clock)
    on_us = b.call_us(); off_us = b.call_us(launch=off)
    res = b.call_us(copy=False)
    b.call_us()
    cp = b.copy_us(); cpd = b.copy_us(dispatch=True)
    s_on = b.launch_split()
    print(f"{wl} {kind} b{batch}: on {on_us:.1f} off {off_us:.1f} ({on_us/off_us-1:+.1%}) resolve {res:.1f} copy {cp:.1f} counter {cpd:.1f} | {bs.split_text(s_on)}", flush=True)
