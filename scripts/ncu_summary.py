"""One table per Nsight Compute CSV (`ncu --csv --page raw --log-file F`, h200_validate.sh
ncu_probe): a row per profiled launch with its time, DRAM bytes and rate, L2 reads and hit rate,
occupancy, and its largest warp stall reasons (cycles a warp waited per issued instruction).

    python scripts/ncu_summary.py ncu_attn.csv [ncu_mega.csv ...]
"""
import csv
import io
import sys
from collections import defaultdict

STALL = "smsp__average_warps_issue_stalled_"


def launches(path):
    """{launch id: {"name", "grid", "block", metric name: (unit, value)}} from one ncu CSV log, either
    page: details (a row per metric) or raw (a row per launch, units in the row under the header)."""
    text = open(path).read()
    start = text.find('"ID"')
    if start < 0:
        return {}
    rows = defaultdict(dict)
    reader = csv.DictReader(io.StringIO(text[start:]))
    units = {}
    for r in reader:
        if not r.get("ID", "").isdigit():
            units = units or r             # raw page: the units row
            continue
        k = rows[int(r["ID"])]
        k.update(name=r["Kernel Name"], grid=r["Grid Size"], block=r["Block Size"])
        if "Metric Name" in r:
            k[r["Metric Name"]] = (r["Metric Unit"], r["Metric Value"])
        else:
            k.update({m: (units.get(m, ""), v) for m, v in r.items() if "__" in m})
    return rows


def num(k, name, scale=1.0):
    unit, value = k.get(name, ("", "nan"))
    v = float(value.replace(",", "")) if value not in ("", "n/a") else float("nan")
    return v * {"Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "usecond": 1e-6, "msecond": 1e-3,
                "nsecond": 1e-9, "second": 1.0}.get(unit, 1.0) / scale


def main(paths):
    for path in paths:
        print(f"== {path}")
        print("| id | kernel | grid | us | DRAM read GB | DRAM TB/s | L2 read GB | L2 hit % | occupancy % | top stalls "
              "(cycles / issue) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for i, k in sorted(launches(path).items()):
            secs = num(k, "gpu__time_duration.sum")
            read = num(k, "dram__bytes_read.sum")
            stalls = sorted(((num(k, m), m[len(STALL):].split("_per_issue")[0]) for m in k if m.startswith(STALL)),
                            reverse=True)[:5]
            print(f"| {i} | {k['name'][:40]} | {k['grid']} | {secs * 1e6:.1f} | {read / 1e9:.3f} | "
                  f"{read / secs / 1e12:.2f} | {num(k, 'lts__t_sectors_srcunit_tex_op_read.sum') * 32 / 1e9:.3f} | "
                  f"{num(k, 'lts__t_sector_op_read_hit_rate.pct'):.1f} | {num(k, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} | "
                  + ", ".join(f"{n} {v:.1f}" for v, n in stalls) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
