"""The rollout job (rollout/job.py, scripts/rollout.py, conf/) on the embedded arith model,
CPU: parquet rows, resume after a kill, the offline W&B run read back, bad config."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from rollout.job import load_prompts, register_configs, run
from rollout.metrics import read_offline_run
from rollout.tasks import arith

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = {"prompt_index", "prompt", "prompt_ids", "sample_index", "completion_ids", "text", "logprobs",
           "processed_logprobs", "policy_versions", "finish_reason", "reward"}
N, LIMIT, WAVE = 4, 24, 8
register_configs()


def make_cfg(tmp, *overrides, experiment="grpo"):
    # log_every_s=0: a W&B row every worker step. This ~300-token run can end inside any fixed
    # interval on a fast CPU, leaving no row with sequences running.
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            f"+experiment={experiment}", f"sampling.n={N}", f"data.limit={LIMIT}", f"batch_prompts={WAVE}",
            f"output_dir={tmp / 'out'}", "logging.mode=offline", f"logging.dir={tmp / 'wb'}",
            "logging.log_every_s=0", *overrides])


def rows_of(out) -> list[dict]:
    rows = pq.read_table(Path(out) / "rollouts").to_pylist()   # pyarrow skips the hidden tmp files
    return sorted(rows, key=lambda r: (r["prompt_index"], r["sample_index"]))


def child_env():
    # Run this checkout's package whatever `pip install -e` points at; never go online.
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("job")
    summary = run(make_cfg(tmp))
    return tmp, summary, rows_of(tmp / "out")


def test_rows_complete_and_consistent(full_run):
    tmp, summary, rows = full_run
    assert len(rows) == LIMIT * N and set(rows[0]) == COLUMNS
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, g) for i in range(LIMIT) for g in range(N)]
    shipped = [json.loads(line)["prompt"] for line in (ROOT / "data/arith_prompts.jsonl").read_text().splitlines()]
    for r in rows:
        k = len(r["completion_ids"])
        assert k >= 1 and len(r["logprobs"]) == len(r["processed_logprobs"]) == len(r["policy_versions"]) == k
        assert r["policy_versions"] == [0] * k
        assert all(lp <= 0 for lp in r["logprobs"])
        assert r["prompt"] == shipped[r["prompt_index"]] and r["prompt_ids"][0] == 1   # <bos>
        assert r["finish_reason"] in ("stop", "length")
        assert r["reward"] in (0.0, 1.0) and r["reward"] == arith.reward(r["prompt"], r["text"])
    assert len(list((tmp / "out/rollouts").glob("part-*.parquet"))) == LIMIT // WAVE
    mean = sum(r["reward"] for r in rows) / len(rows)
    assert mean > 0.5                        # the embedded model gets ~83% at temperature 1
    assert summary["prompts"] == LIMIT and summary["completions"] == LIMIT * N
    assert summary["tokens"] == sum(len(r["completion_ids"]) for r in rows)
    assert summary["mean_reward"] == pytest.approx(mean) and summary["gpu_busy"] == "n/a"


def test_wandb_offline_run_has_metrics(full_run):
    tmp, summary, _ = full_run
    (run_dir,) = (tmp / "wb/wandb").glob("offline-run-*")
    history, final = read_offline_run(run_dir)
    *history, table = history                # close(): nothing generated since the last row, the table alone
    assert "throughput/gen_tok_s" not in table
    assert len(history) >= 2
    assert max(h["throughput/gen_tok_s"] for h in history) > 0
    assert max(h["throughput/prefill_tok_s"] for h in history) > 0
    assert all(h["kv/pages_used"] >= 0 and 0 <= h["batch/occupancy"] <= 1 for h in history)
    assert max(h["batch/running"] for h in history) > 0
    last = history[-1]
    assert last["tokens/version_age_0"] == summary["tokens"]       # nothing is stale: one version
    assert last["tokens/wasted"] == last["tokens/discarded"] + last["tokens/aborted"] >= 0
    assert last["sched/preemptions"] >= 0 and last["weights/updates"] == 0
    assert last["weights/staging_ms"] == last["weights/barrier_ms"] == 0
    assert "gpu/busy_pct" not in last                              # CUDA only
    assert last["rollouts/completions"] == LIMIT * N
    assert table["samples/_type"] == "table-file" and table["samples/nrows"] == 64
    samples = json.loads((run_dir / "files" / table["samples/path"]).read_text())
    assert samples["columns"] == ["prompt", "text", "reward", "finish_reason"]
    assert final["completions"] == LIMIT * N and final["mean_reward"] == pytest.approx(summary["mean_reward"])


def test_resume_after_partial_runs_and_a_killed_write(full_run, tmp_path):
    ref = full_run[2]
    first = run(make_cfg(tmp_path, f"data.limit={WAVE}"))            # stops after the first wave
    assert first["parts"] == 1
    part0 = tmp_path / "out/rollouts/part-00000.parquet"
    before = part0.read_bytes()
    assert run(make_cfg(tmp_path))["skipped_prompts"] == WAVE        # resumes with waves 2 and 3
    # Simulate a kill during the last wave's write: its part never got renamed into place.
    (tmp_path / "out/rollouts/part-00002.parquet").unlink()
    (tmp_path / "out/rollouts/.part-00002.parquet.tmp").write_bytes(b"half a parquet file")
    again = run(make_cfg(tmp_path))
    assert again["skipped_prompts"] == 2 * WAVE and again["prompts"] == WAVE
    assert part0.read_bytes() == before                              # committed rows untouched
    assert not list((tmp_path / "out/rollouts").glob(".*.tmp"))
    rows = rows_of(tmp_path / "out")
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, g) for i in range(LIMIT) for g in range(N)]
    # Seeds are keyed on the prompt index: the pieced-together output is the uninterrupted one.
    for a, b in zip(rows, ref):
        assert a["completion_ids"] == b["completion_ids"] and a["text"] == b["text"]
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    assert run(make_cfg(tmp_path))["prompts"] == 0                   # nothing left to do


def test_resume_after_sigkill(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts/rollout.py"), "+experiment=grpo", "sampling.n=4",
           "data.limit=128", "batch_prompts=4", f"output_dir={out}", "logging=none"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parts, deadline = out / "rollouts", time.time() + 120
    while not (parts.exists() and list(parts.glob("part-*.parquet"))) and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    kept = {p.name: p.read_bytes() for p in parts.glob("part-*.parquet")}
    assert 1 <= len(kept) < 32
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=cmd[2:])
    summary = run(cfg)
    assert summary["skipped_prompts"] == 4 * len(kept)
    assert all((parts / name).read_bytes() == data for name, data in kept.items())
    rows = rows_of(out)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, g) for i in range(128) for g in range(4)]


def test_bad_overrides_fail_clearly(tmp_path):
    with pytest.raises(ConfigCompositionException) as e:
        make_cfg(tmp_path, "sampling.n=abc")
    assert "sampling.n=abc" in str(e.value) and "could not be converted to Integer" in str(e.value.__cause__)
    with pytest.raises(ConfigCompositionException, match="foo"):
        make_cfg(tmp_path, "foo=1")
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a finite number >= 1e-05, got -1.0"):
        run(make_cfg(tmp_path, "sampling.temperature=-1"))
    with pytest.raises(ValueError, match=r"model\.path"):
        run(make_cfg(tmp_path, "model=local"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "wb").exists()   # nothing written


def test_short_run_logs_a_row_per_part(tmp_path):
    # The default log_every_s (10 s) is longer than this run: a row per committed part, each
    # over a window with tokens in it, and the next wave in flight when the first part lands.
    run(make_cfg(tmp_path, "logging.log_every_s=10"))
    (run_dir,) = (tmp_path / "wb/wandb").glob("offline-run-*")
    rows = [h for h in read_offline_run(run_dir)[0] if "throughput/gen_tok_s" in h]
    assert len(rows) == LIMIT // WAVE
    assert all(h["throughput/gen_tok_s"] > 0 for h in rows)     # a wave's prefill may fall in the window before
    assert rows[0]["throughput/prefill_tok_s"] > 0 and rows[0]["batch/running"] > 0 and rows[0]["kv/pages_used"] > 0
    assert [h["rollouts/completions"] for h in rows] == [WAVE * N * (k + 1) for k in range(LIMIT // WAVE)]


def test_resume_over_a_part_with_the_old_group_column(full_run, tmp_path):
    import pyarrow.parquet as pq
    assert run(make_cfg(tmp_path, f"data.limit={WAVE}"))["parts"] == 1
    part0 = tmp_path / "out/rollouts/part-00000.parquet"
    t = pq.read_table(part0)
    pq.write_table(t.rename_columns(["group" if c == "sample_index" else c for c in t.column_names]), part0)
    again = run(make_cfg(tmp_path))
    assert again["skipped_prompts"] == WAVE and again["prompts"] == LIMIT - WAVE
    old = pq.read_table(part0).to_pylist()
    new = [r for p in sorted(part0.parent.glob("part-*.parquet"))[1:] for r in pq.read_table(p).to_pylist()]
    got = [(r["prompt_index"], r["group"]) for r in old] + [(r["prompt_index"], r["sample_index"]) for r in new]
    assert sorted(got) == [(i, g) for i in range(LIMIT) for g in range(N)]
    # the resumed parts equal the uninterrupted run's rows for those prompts
    ref = {(r["prompt_index"], r["sample_index"]): r["completion_ids"] for r in full_run[2]}
    assert all(r["completion_ids"] == ref[r["prompt_index"], r["sample_index"]] for r in new)


def test_resume_refuses_another_config(full_run):
    tmp = full_run[0]
    with pytest.raises(ValueError, match="another config") as e:
        run(make_cfg(tmp, "sampling.temperature=0.5", "sampling.top_k=5"))
    # only the keys that differ, as dotted paths, old -> new
    assert str(e.value).endswith("job.json): sampling.temperature: 1.0 -> 0.5; sampling.top_k: 0 -> 5; "
                                 "use a new output_dir"), str(e.value)


def test_prompt_sources(tmp_path):
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(arith.default_model_path()))
    msgs = [{"prompt": [{"role": "user", "content": p}]} for p in ("1+2=", "30-4=")]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    data = make_cfg(tmp_path, "data=jsonl", f"data.path={path}").data
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat.jsonl row 0: 'prompt' is a message list but the tokenizer has no chat"):
        load_prompts(data, tok)
    tok.chat_template = "<bos>{% for m in messages %}{{ m['content'] }}{% endfor %}"
    got = load_prompts(data, tok)            # the template's <bos> only: no second one added
    assert got == [(f"<bos>{p}", [1] + tok(p, add_special_tokens=False).input_ids) for p in ("1+2=", "30-4=")]
    assert tok("1+2=").input_ids == got[0][1]
    # parquet file and a save_to_disk folder; plain strings are used as is
    ds = datasets.Dataset.from_dict({"q": ["7+7=", "9-1="]})
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "folder"))
    for src in ("p.parquet", "folder"):
        data = make_cfg(tmp_path, "data=jsonl", f"data.path={tmp_path / src}", "data.prompt_field=q",
                        "data.limit=1").data
        assert load_prompts(data, tok) == [("7+7=", tok("7+7=").input_ids)]   # tokenized as the engine does
    with pytest.raises(ValueError, match="no column 'prompt'"):
        load_prompts(make_cfg(tmp_path, "data=jsonl", f"data.path={tmp_path / 'p.parquet'}").data, tok)


def test_cli_runs(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/rollout.py"), "+experiment=grpo", "data.limit=16",
                           f"output_dir={out}"], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout: 16 prompts" in proc.stdout
    assert len(rows_of(out)) == 16 * 8
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
