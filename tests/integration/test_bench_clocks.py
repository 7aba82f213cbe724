"""bench.clocks: nvidia-smi samples matched to step_variants' timed windows."""
import json
import os

from rollout.bench import clocks


def test_windows_take_the_samples_inside_each_timed_window(tmp_path, capsys):
    smi = tmp_path / "smi.csv"
    smi.write_text("timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temp, reasons\n"
                   "2026/12/02 08:00:00.000, 1980 MHz, 3201 MHz, 500.00 W, 40, 0x0000000000000000\n"
                   "2026/12/02 08:00:01.000, 1980 MHz, 3201 MHz, 600.00 W, 41, 0x0000000000000000\n"
                   "2026/12/02 08:00:02.000, 1700 MHz, 3201 MHz, 700.00 W, 45, 0x0000000000000004\n"
                   "2026/12/02 08:00:03.0")                  # cut off when the log was stopped
    t = 1796198400.0                                         # 2026-12-02 08:00:00 UTC
    rows = [dict(variant="base", steps=100, step_ms=10.0, fraction=0.82, unix_time_end=t + 1.0),   # 08:00:00-01
            dict(variant="mega", steps=100, step_ms=10.0, fraction=0.80, unix_time_end=t + 2.0),   # 08:00:01-02
            dict(variant="x", error="out of shared memory")]
    (tmp_path / "sv.json").write_text(json.dumps(dict(rows=rows)))
    w = clocks.windows(rows, clocks.read_smi(str(smi)))
    assert [x["variant"] for x in w] == ["base", "mega"]
    assert w[0]["samples"] == 2 and w[0]["watts"] == 550 and w[0]["sm_mhz_min"] == 1980 and w[0]["reasons"] == 0
    assert w[1]["samples"] == 2 and w[1]["sm_mhz_min"] == 1700 and w[1]["watts_max"] == 700 and w[1]["reasons"] == 4
    assert clocks.main([str(tmp_path / "sv.json"), str(smi)]) == 0
    assert "mega" in capsys.readouterr().out


def test_rows_with_a_start_take_the_samples_between_start_and_end(tmp_path):
    """bench.attn_ceiling --hold rows: a name, no step count, the window's start and end."""
    smi = tmp_path / "smi.csv"
    smi.write_text("2026/12/02 08:00:00.000, 1980 MHz, 3201 MHz, 500.00 W, 40, 0x0000000000000000\n"
                   "2026/12/02 08:00:00.500, 1760 MHz, 3201 MHz, 690.00 W, 41, 0x0000000000000004\n"
                   "2026/12/02 08:00:01.000, 1750 MHz, 3201 MHz, 700.00 W, 45, 0x0000000000000004\n")
    t = 1796198400.0
    rows = [dict(name="ours gluon=32,6", us_per_layer=137.0, unix_time_start=t + 0.25, unix_time_end=t + 1.0)]
    w = clocks.windows(rows, clocks.read_smi(str(smi)))
    assert len(w) == 1 and w[0]["variant"] == "ours gluon=32,6" and w[0]["fraction"] is None
    assert w[0]["samples"] == 2 and w[0]["sm_mhz"] == 1755 and w[0]["reasons"] == 4


def test_logged_summarizes_what_nvidia_smi_printed_while_the_block_ran(tmp_path, monkeypatch):
    """clocks.logged() runs nvidia-smi beside a block (here a stand-in script on PATH that prints
    two samples, the second at the power limit) and fills its dict when the block ends; without
    nvidia-smi the dict stays empty."""
    import stat
    import time
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "echo '2026/12/02 08:00:00.000, 1980 MHz, 3201 MHz, 600.00 W, 40, 0x0000000000000000'\n"
                    "echo '2026/12/02 08:00:00.100, 1500 MHz, 3201 MHz, 700.00 W, 41, 0x0000000000000004'\n"
                    "exec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with clocks.logged() as g:
        assert g == {}
        time.sleep(0.5)
    assert g["samples"] == 2 and g["sm_mhz"] == 1740 and g["sm_mhz_min"] == 1500 and g["watts_max"] == 700
    assert g["power_capped"] == 0.5
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with clocks.logged() as g:
        pass
    assert g == {}


def test_brief_is_the_tables_cell_for_a_summary():
    g = clocks.summarize([(0.0, 1980.0, 600.0, 0), (0.1, 1500.0, 700.0, 0x4)])
    assert clocks.brief(g) == "1740 MHz (min 1500), 650 W, 50%"
    assert clocks.brief({}) == "n/a"                  # no nvidia-smi: the run still prints its row
