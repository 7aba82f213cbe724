"""The README's option table is EngineConfig's: every field once, in order, with its default."""
import dataclasses
import re
from pathlib import Path

from rollout.config import EngineConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_engine_option_with_its_default():
    text = README.read_text()
    table = text[text.index("<!-- engine-config"):text.index("<!-- /engine-config -->")]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \|", table, re.M)
    fields = dataclasses.fields(EngineConfig)
    assert [name for name, _ in rows] == [f.name for f in fields]
    defaults = EngineConfig()
    for name, shown in rows:
        if name == "kernels":         # from the environment (rollout.env), not a literal
            continue
        assert shown == f"`{getattr(defaults, name)!r}`".replace("'", '"'), name


def test_readme_names_no_removed_option_or_bench():
    text = README.read_text()
    for gone in ("decode_megakernel", "ROLLOUT_GLUON_DECODE=BLOCK_N", "wait_first", "rollout.bench.kernels",
                 "rollout.bench.occupancy --", "torch_threads", "session"):
        assert gone not in text, gone
