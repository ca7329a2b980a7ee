import torch, kvplan
print("tree:", kvplan.__file__, flush=True)
from kvplan.benchmarks import swap_in as bs
from kvplan.kernels import hisparse as H
dev = torch.device("cuda")
shape = bs.Shape(smoke=False)
clock = bs.Clock(dev, 10)
off = H.ResolveLaunch(shared_rows=False)
for cache, cells in (("A", [("A","spec",8),("A","single",64)]), ("B", [("C","single",8),("C","spec",8),("B","single",8),("C","spec",64)])):
    hosts = bs.pinned_hosts(shape.host_rows[cache], 1 + bs.REPLAY_LAYERS, dev)
    for wl, kind, batch in cells:
        w = bs.make_workload(wl, batch=batch, speculative=kind == "spec", calls=max(4, min(32, 256 // batch)), shape=shape, device=dev, seed=batch)
        b = bs.Bench(w, hosts, clock)
        on = [b.call_us() for _ in range(3)]
        offs = [b.call_us(launch=off) for _ in range(2)] if wl != "A" else [float("nan")]
        b.call_us()
        print(f"{wl} {kind} b{batch}: on {min(on):.1f} ({' '.join(f'{x:.1f}' for x in on)}) off {min(offs):.1f} ({min(on)/min(offs)-1:+.1%}) | {bs.split_text(b.launch_split())}", flush=True)
    del hosts
