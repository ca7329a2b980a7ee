import csv, sys, collections
rows = list(csv.reader(open("src_cuda.csv")))
# split into kernels
sections = []
cur = None
for r in rows:
    if r and r[0] == "File Path":
        cur = []; sections.append(cur); continue
    if cur is not None: cur.append(r)
hdr = sections[0][1]
idx = {h: i for i, h in enumerate(hdr)}
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
PRELUDE = int(sys.argv[2])
src = open("/work/main/kvplan/kernels/onchip/resolve.cu").read().splitlines()
k = int(sys.argv[1])
sec = sections[k]
lines = [r for r in sec[2:] if r and r[0] not in ("",)]
tot = sum(int(r[idx["Warp Stall Sampling (All Samples)"]]) for r in lines)
print("kernel", k, "total samples", tot, "instr", sum(int(r[idx["Instructions Executed"]] or 0) for r in lines))
agg = collections.Counter()
for r in lines:
    agg[int(r[0])] += int(r[idx["Warp Stall Sampling (All Samples)"]])
# by stall reason totals
reason = collections.Counter()
for r in lines:
    for s in stalls:
        v = r[idx[s]]
        if v not in ("", "-"): reason[s] += int(v)
print("reasons:", ", ".join(f"{s[6:]} {v*100/tot:.1f}%" for s, v in reason.most_common(8)))
for ln, v in sorted(agg.items(), key=lambda x: -x[1])[:int(sys.argv[3]) if len(sys.argv) > 3 else 30]:
    r = next(r for r in lines if int(r[0]) == ln)
    top = sorted(((int(r[idx[s]]) if r[idx[s]] not in ("", "-") else 0, s[6:]) for s in stalls), reverse=True)[:3]
    text = src[ln - PRELUDE - 1].strip()[:80] if 0 < ln - PRELUDE <= len(src) else "?"
    print(f"{v*100/tot:5.1f}% L{ln - PRELUDE:4d} {int(r[idx['Instructions Executed']]):>8} {top} | {text}")
