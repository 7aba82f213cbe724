"""GPU clocks and power over each timed window of a step_variants run, from an nvidia-smi log
taken beside it (does a variant slow down as the GPU reaches its power limit?):

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\\
        clocks_event_reasons.active --format=csv,noheader -lms 250 > smi.csv &
    python -m rollout.bench.step_variants ... --out sv.json
    python -m rollout.bench.clocks sv.json smi.csv

`logged()` takes the same log around one block (the main bench's `gpu_clocks`).
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
SW_POWER_CAP = 0x4          # nvidia-smi's clocks_event_reasons bit: the board is at its power limit


def read_smi(path: str) -> list[tuple[float, float, float, int]]:
    """(unix time, SM MHz, W, clock event reasons bitmask) for each parsable line."""
    out = []
    for r in csv.reader(open(path)):
        try:
            t = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
            out.append((t.replace(tzinfo=datetime.timezone.utc).timestamp(), float(r[1].split()[0]),
                        float(r[3].split()[0]), int(r[5].strip(), 16)))
        except (ValueError, IndexError):      # the header, or a line cut off when the log was stopped
            continue
    return out


def summarize(samples: list[tuple]) -> dict:
    """Mean / min SM clock, mean / max power, and the share of samples at the power limit."""
    if not samples:
        return {}
    n = len(samples)
    return dict(samples=n, sm_mhz=sum(s[1] for s in samples) / n, sm_mhz_min=min(s[1] for s in samples),
                watts=sum(s[2] for s in samples) / n, watts_max=max(s[2] for s in samples),
                power_capped=sum(bool(s[3] & SW_POWER_CAP) for s in samples) / n)


def brief(g: dict) -> str:
    """summarize()'s fields for a table cell: mean (min) SM clock, mean power, share at the limit."""
    if not g:
        return "n/a"
    return f"{g['sm_mhz']:.0f} MHz (min {g['sm_mhz_min']:.0f}), {g['watts']:.0f} W, {100 * g['power_capped']:.0f}%"


@contextlib.contextmanager
def logged(gpu: int = 0, period_ms: int = 100):
    """nvidia-smi's clocks and power of GPU `gpu` every period_ms while the block runs. Yields a dict
    that holds summarize()'s fields once the block ends (stays empty without nvidia-smi)."""
    out: dict = {}
    exe = shutil.which("nvidia-smi")
    if exe is None:
        yield out
        return
    fd, path = tempfile.mkstemp(suffix=".csv")
    with os.fdopen(fd, "w") as f:
        proc = subprocess.Popen([exe, f"--query-gpu={QUERY}", "--format=csv,noheader", "-i", str(gpu),
                                 "-lms", str(period_ms)], stdout=f, stderr=subprocess.DEVNULL)
        try:
            yield out
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    out.update(summarize(read_smi(path)))
    os.unlink(path)


def windows(rows: list[dict], smi: list[tuple]) -> list[dict]:
    """Per timed row: the samples inside [end - steps * step_ms, end] (the GPU is busy throughout),
    or [unix_time_start, unix_time_end] where a row has both."""
    out = []
    for r in (r for r in rows if "unix_time_end" in r):
        t1 = r["unix_time_end"]
        t0 = r.get("unix_time_start", t1 - r.get("steps", 0) * r.get("step_ms", 0) / 1e3)
        w = [s for s in smi if t0 <= s[0] <= t1]
        if w:
            out.append(dict(variant=r.get("variant", r.get("name")), fraction=r.get("fraction"), **summarize(w),
                            reasons=max(s[3] for s in w)))
    return out


def main(argv=None) -> int:
    sv, smi = (argv if argv is not None else sys.argv[1:])[:2]
    for w in windows(json.load(open(sv))["rows"], read_smi(smi)):
        share = f"{100 * w['fraction']:5.1f}%" if w["fraction"] is not None else ""
        print(f"{w['variant']:12s} {share}  {w['samples']:4d} samples  SM {w['sm_mhz']:.0f} MHz "
              f"(min {w['sm_mhz_min']:.0f})  {w['watts']:.0f} W (max {w['watts_max']:.0f})  "
              f"clock event reasons {hex(w['reasons'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
