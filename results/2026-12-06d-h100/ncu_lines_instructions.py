import csv, sys, collections
rows = list(csv.reader(open("src_cuda.csv")))
sections = []; cur = None
for r in rows:
    if r and r[0] == "File Path": cur = []; sections.append(cur); continue
    if cur is not None: cur.append(r)
hdr = sections[0][1]; idx = {h: i for i, h in enumerate(hdr)}
PRELUDE = 37
src = open(sys.argv[2]).read().splitlines()
sec = sections[int(sys.argv[1])]
lines = [r for r in sec[2:] if r and r[0] != ""]
tot = sum(int(r[idx["Instructions Executed"]] or 0) for r in lines)
print("total warp instr", tot, "per block", tot // 8)
agg = sorted(((int(r[idx["Instructions Executed"]] or 0), int(r[0])) for r in lines), reverse=True)
for v, ln in agg[:int(sys.argv[3])]:
    text = src[ln - PRELUDE - 1].strip()[:90] if 0 < ln - PRELUDE <= len(src) else "?"
    print(f"{v*100/tot:5.1f}% {v//8:>7} L{ln - PRELUDE:4d} | {text}")
