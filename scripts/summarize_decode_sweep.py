"""One line per (shape, page size, layout) of a `rollout.bench.kernels` decode sweep: the engine's
current config (auto splits, 64-key tiles, 4 warps, 2 stages) and the fastest one."""
import json
import sys

d = json.load(open(sys.argv[1]))
print(f"copy {d['copy_GBps']:.0f} GB/s")
print("| B x ctx | page | layout | engine config us (GB/s) | best us (GB/s) "
      "| best (splits, block_n, warps, stages) | max err |")
print("|---|---|---|---|---|---|---|")
for r in d["results"]:
    if r.get("kind") != "decode" or not r["configs"]:
        continue
    eng = [c for c in r["configs"] if (c["num_splits"], c["block_n"], c["num_warps"], c["num_stages"])
           == (r["auto_num_splits"], 64, 4, 2)]
    b = r["best"]
    e = f"{eng[0]['us']:.1f} ({eng[0]['GBps']:.0f})" if eng else "-"
    err = max(c["max_err"] or 0 for c in r["configs"])
    print(f"| {r['B']}x{r['ctx']} | {r['page_size']} | {r.get('layout', 'token')} | {e} "
          f"| {b['us']:.1f} ({b['GBps']:.0f}) "
          f"| {b['num_splits']}, {b['block_n']}, {b['num_warps']}, {b['num_stages']} | {err:.1e} |")
