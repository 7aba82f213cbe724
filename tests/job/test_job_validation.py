"""The rollout job checks everything before it writes anything: every prompt (length,
vocabulary), empty data, data.limit, a broken model folder, the reward function; and chat
prompts on the embedded model. Each error names the row, file or setting, and no output
directory exists after it."""
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_job import make_cfg, rows_of
from transformers import AutoTokenizer

from rollout.job import load_prompts, run
from rollout.tasks import arith


def nothing_written(tmp):
    return not (tmp / "out").exists() and not (tmp / "wb").exists()


def jsonl(path, rows):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return path


def test_a_long_prompt_fails_before_any_part(tmp_path):
    # 24 rows, waves of 8: without the up-front check parts 0 and 1 were written before row 16 failed
    prompts = [f"{i}+1=" for i in range(24)]
    prompts[16] = "1+" * 40 + "1="           # 82 characters + <bos>: over arith-tiny's 64 positions
    path = jsonl(tmp_path / "p.jsonl", prompts)
    with pytest.raises(ValueError, match=r"p\.jsonl row 16: the prompt has 83 tokens; engine\.max_model_len=64"):
        run(make_cfg(tmp_path, "data=jsonl", f"data.path={path}"))
    assert nothing_written(tmp_path)
    # engine.max_model_len when set: rows 0-9 have 5 tokens (<bos>0+1=), row 10 the first with 6
    with pytest.raises(ValueError, match="row 10: the prompt has 6 tokens; engine.max_model_len=6"):
        run(make_cfg(tmp_path, "data=jsonl", f"data.path={path}", "engine.max_model_len=6"))
    assert nothing_written(tmp_path)


def test_prompt_ids_outside_the_vocabulary(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(arith.default_model_path()))
    data = make_cfg(tmp_path, "data=jsonl", f"data.path={jsonl(tmp_path / 'p.jsonl', ['1+1=', '1 +1='])}").data
    assert load_prompts(data, tok, 64, 18)[1] == ("1 +1=", [1, 5, 17, 14, 5, 16])
    # a model whose vocabulary ended before " " (id 17): row 1 is the first that cannot be embedded
    with pytest.raises(ValueError, match=r"p\.jsonl row 1: the prompt has token ids outside the model's "
                                         r"vocabulary \[0, 17\)"):
        load_prompts(data, tok, 64, 17)


@pytest.mark.parametrize("name,content", [("empty.jsonl", ""), ("blank.jsonl", "\n \n"), ("list.json", "[]"),
                                          ("empty.parquet", None)])
def test_empty_data_says_so(tmp_path, name, content):
    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"data.path '{path}' has no rows"):
        run(make_cfg(tmp_path, "data=jsonl", f"data.path={path}"))
    assert nothing_written(tmp_path)


@pytest.mark.parametrize("limit", [0, -3])
def test_data_limit_below_one(tmp_path, limit):
    with pytest.raises(ValueError, match=f"data.limit must be >= 1 or null \\(every row\\), got {limit}"):
        run(make_cfg(tmp_path, f"data.limit={limit}"))
    assert nothing_written(tmp_path)


@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(arith.default_model_path(), dst)
    return dst


def test_truncated_safetensors_names_the_file(tmp_path, model_copy):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])      # header intact, tensors cut off
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        run(make_cfg(tmp_path, "model=local", f"model.path={model_copy}"))
    weights.write_bytes(b"\x05")                             # not even a header
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        run(make_cfg(tmp_path, "model=local", f"model.path={model_copy}"))
    assert nothing_written(tmp_path)


def test_garbage_config_json_names_the_file(tmp_path, model_copy):
    config = model_copy / "config.json"
    config.write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match=f"{config} is not valid JSON"):
        run(make_cfg(tmp_path, "model=local", f"model.path={model_copy}"))
    config.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match=f"{config} is not valid JSON"):
        run(make_cfg(tmp_path, "model=local", f"model.path={model_copy}"))
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{config}: expected a JSON object, got list"):
        run(make_cfg(tmp_path, "model=local", f"model.path={model_copy}"))
    assert nothing_written(tmp_path)


@pytest.mark.parametrize("setting,message", [
    ("no_such_module_xyz:score", r"reward='no_such_module_xyz:score': cannot load 'score' from module "
                                 r"'no_such_module_xyz': ModuleNotFoundError"),
    ("rollout.tasks.arith:no_such_fn", r"reward='rollout.tasks.arith:no_such_fn': cannot load 'no_such_fn'"),
    ("rollout.tasks.arith:OPS", r"reward='rollout.tasks.arith:OPS': rollout.tasks.arith:OPS is a tuple, "
                                r"not a function"),
    ("rollout.tasks.arith:solve", r"reward='rollout.tasks.arith:solve': rollout.tasks.arith:solve must take "
                                  r"\(prompt, completion\)"),
    ("rollout.tasks.arith", r"reward='rollout.tasks.arith': expected 'arith', 'package.module:function' or null"),
])
def test_bad_reward_setting_fails_at_start(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        run(make_cfg(tmp_path, f"reward={setting}"))
    assert nothing_written(tmp_path)


def test_custom_reward_is_called_with_prompt_and_completion_text(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "calls = []\n"
        "def score(prompt, completion):\n"
        "    calls.append((prompt, completion))\n"
        "    return float(len(completion))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_reward
    summary = run(make_cfg(tmp_path, "reward=my_reward:score", "data.limit=8"))
    rows = rows_of(tmp_path / "out")
    assert len(my_reward.calls) == len(rows) == summary["completions"] == 8 * 4    # once per completion
    assert sorted(my_reward.calls) == sorted((r["prompt"], r["text"]) for r in rows)
    assert all(r["reward"] == len(r["text"]) for r in rows)


def test_chat_prompts_on_the_embedded_model(tmp_path):
    # The shipped tokenizer's chat template renders one user message to <bos> + its text: the
    # ids the model was trained on, so the answers are as good as with plain prompts.
    problems = [p for p, _ in (arith.make_problem(arith.random.Random(7)) for _ in range(16))]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}]}) + "\n" for p in problems))
    summary = run(make_cfg(tmp_path, "data=jsonl", f"data.path={path}", "sampling.temperature=0"))
    rows = rows_of(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(str(arith.default_model_path()))
    assert [r["prompt"] for r in rows[::4]] == [f"<bos>{p}" for p in problems]
    assert [r["prompt_ids"] for r in rows[::4]] == [tok(p).input_ids for p in problems]
    plain = run(make_cfg(tmp_path / "plain", "data=jsonl", f"data.path={jsonl(tmp_path / 'p.jsonl', problems)}",
                         "sampling.temperature=0"))
    assert [r["completion_ids"] for r in rows] == [r["completion_ids"] for r in rows_of(tmp_path / "plain/out")]
    assert summary["mean_reward"] == plain["mean_reward"] > 0.5    # arith.reward reads the rendered prompt too
