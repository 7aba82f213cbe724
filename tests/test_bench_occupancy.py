"""bench.occupancy: the decode step's kernels compiled for sm_90a here (no GPU), their programs an SM
and waves. The rows it prints are what the next device sweep is chosen by (h200_validate.sh one_wave),
so the facts it rests on are asserted: QKV's 96 programs, packed gate_up's one program an SM, decode
attention's one an SM, and a QKV config of 192 programs in one wave."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_programs_an_sm_from_shared_memory_registers_and_threads():
    from rollout.bench.occupancy import per_sm
    assert per_sm(147456, 78, 4) == 1 and per_sm(98304, 80, 4) == 2 and per_sm(65536, 96, 4) == 3
    assert per_sm(1024, 255, 8) == 1              # registers bind: 255 x 256 threads of 65,536
    assert per_sm(0, 16, 1) == 64                 # threads bind: 2,048 an SM


def test_llama3_8b_decode_step_at_32_rows(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = tmp_path / "occ.json"
    run = subprocess.run([sys.executable, "-m", "rollout.bench.occupancy", "--shape", "llama3-8b", "--batch", "32",
                          "--packed", "--gemm", "qkv=64,128,4,3,2", "--out", str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(out.read_text())
    rows = {r["kernel"]: r for r in got["rows"]}
    assert rows["qkv"]["config"] == "64,128,4,3,2" and rows["qkv"]["programs"] == 192
    assert rows["qkv"]["per_sm"] == 2 and rows["qkv"]["waves"] < 1          # the override fits one wave
    assert rows["gate_up"]["programs"] == 224 and rows["gate_up"]["per_sm"] == 1 and rows["gate_up"]["waves"] > 1.5
    assert rows["o"]["programs"] == rows["down"]["programs"] == 128             # 64-row tiles split in two
    att = rows["attention (gluon)"]
    assert att["programs"] == 256 and att["per_sm"] == 1 and att["config"] == "128,2,keys,8"
    assert "| qkv | 64,128,4,3,2 | 192 |" in run.stdout and got["meta"]["command"].startswith("python -m")
    table = subprocess.run([sys.executable, "-m", "rollout.bench.occupancy", "--packed"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert "| qkv | 64,128,4,5 | 96 |" in table.stdout                      # the table's QKV: 36 SMs idle


def test_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "rollout.bench.occupancy"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0 and "without TRITON_INTERPRET" in run.stderr
