"""The step_variants bench's comparison with its neighbouring baseline rows (CPU: the bench itself
needs CUDA, its bookkeeping does not)."""
import pytest

from rollout.bench.step_variants import vs_base


def test_vs_base_compares_each_variant_with_the_mean_of_its_neighbouring_baselines():
    rows = [dict(variant="base", fraction=0.80), dict(variant="a", fraction=0.815),
            dict(variant="base", fraction=0.81), dict(variant="b", error="out of shared memory"),
            dict(variant="c", fraction=0.79), dict(variant="base", fraction=0.82),
            dict(variant="d", fraction=0.83)]
    vs_base(rows)
    assert rows[1]["vs_base"] == pytest.approx(0.815 - 0.805)     # between two baselines
    assert "vs_base" not in rows[3]                                # failed: nothing to compare
    assert rows[4]["vs_base"] == pytest.approx(0.79 - 0.815)       # skips the failed row
    assert rows[6]["vs_base"] == pytest.approx(0.83 - 0.82)        # last row: one side only
    assert all("vs_base" not in r for r in rows if r["variant"] == "base")


def test_vs_base_without_a_baseline_leaves_rows_alone():
    rows = [dict(variant="a", fraction=0.8), dict(variant="b", fraction=0.81)]
    vs_base(rows)
    assert all("vs_base" not in r for r in rows)
