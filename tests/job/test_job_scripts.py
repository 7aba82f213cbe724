"""The demo scripts next to the job: scripts/train.py writes under its output dir (never the
tracked bench/results files)."""
import json
import subprocess
import sys

from test_job import ROOT, child_env


def test_train_script_writes_under_its_output_dir(tmp_path):
    tracked = {p: p.read_bytes() for p in (ROOT / "bench/results").glob("grpo_arith_reward.*")}
    out = tmp_path / "train"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/train.py"), "--steps", "1", "--prompts-per-step", "2",
                           "--num-generations", "2", "--report-to", "none", "--output-dir", str(out)],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "grpo_arith_reward.json").read_text())
    assert result["steps"] == [1] and result["threads"] == 1
    assert (out / "grpo_arith_reward.png").read_bytes()[:4] == b"\x89PNG"
    assert {p: p.read_bytes() for p in tracked} == tracked          # the tracked results are left alone
