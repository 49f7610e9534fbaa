"""The fit table of tpu/README.md from compile reports: one row per compile, the largest batch
predicted by the line through two compiles, and the cost at the roofline."""

import json

import pytest

from benchmarks import tpu_table

GIB = 2**30
TARGET = {"topology": "v5e:2x4", "kind": "TPU v5 lite", "chips": 8, "hosts": 1,
          "hbm_bytes_per_chip": 16 * GIB}  # fmt: skip


def _row(batch, need, *, roofline=None, largest=None):
    row = {"batch": batch, "per_chip_batch": batch // 8, "param_sharding": "replicated",
           "remat": True, "index": "host", "fits": need <= 16 * GIB}  # fmt: skip
    if row["fits"]:
        row["memory"] = {"total": need}
    else:
        row["needed_bytes"] = need
    if roofline:
        row["roofline"] = roofline
    if largest:
        row["largest"] = largest
    return row


def test_a_row_per_compile_with_hours_and_cost_at_the_roofline():
    roof = {"step_s": 0.9, "bound": "compute", "mfu_ceiling": 0.75}
    report = {"target": TARGET, "train": [_row(128, 12 * GIB, roofline=roof)], "generate": []}
    (line,) = tpu_table.train_rows(report, steps=4000)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:7] == ["v5litepod-8 (v5e:2x4, 1 host)", "replicated", "on", "host",
                         "128 (16)", "12.00 / 16.00", "yes"]  # fmt: skip
    hours = 0.9 * 4000 / 3600
    assert cells[8:] == ["900 (com)", "75%", f"{hours:.2f}", f"${hours * 8 * 1.20:.2f}"]


def test_over_hbm_says_by_how_much():
    report = {"target": TARGET, "train": [_row(256, 19 * GIB)], "generate": []}
    (line,) = tpu_table.train_rows(report, steps=1)
    assert "| no (+3.00) |" in line and line.endswith("| - | - | - | - |")


def test_largest_batch_from_the_line_through_two_compiles_in_two_reports():
    # 10 GiB fixed + 0.25 GiB per example on a chip: 16 GiB holds 24 per chip, 192 in all.
    reports = [
        {"target": TARGET, "train": [_row(b, (10 + 0.25 * b / 8) * GIB)], "generate": []}
        for b in (128, 256)
    ]
    (line,) = tpu_table.largest_rows(reports)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4:] == ["128: 14.00, 256: 18.00", "128 (16)", "192 (24)", "0.25"]
    assert tpu_table.largest_rows(reports[:1]) == []  # one compile: no line to draw


def test_compiles_of_other_kernels_or_another_generator_are_not_fitted_together():
    xla = {"target": TARGET, "train": [_row(128, 14 * GIB)], "generate": []}
    flash_row = dict(_row(256, 18 * GIB), attention_impl="flash", optimizer_impl="fused")
    flash = {"target": TARGET, "train": [flash_row], "generate": []}
    llama = {"target": TARGET, "train": [_row(256, 18 * GIB)], "generate": [],
             "models": {"generator": "/x/tpu/architectures/llama-3.2-1b"}}  # fmt: skip
    assert tpu_table.largest_rows([xla, flash, llama]) == []  # three settings, one compile each
    (line,) = tpu_table.train_rows(flash, steps=1)
    assert "| replicated, flash attention, fused AdamW | on |" in line
    (line,) = tpu_table.train_rows(llama, steps=1)
    assert "| replicated, llama-3.2-1b | on |" in line
    # The config's BART (named by its config field) and the defaults add nothing.
    bart = dict(xla, models={"generator": "config.model.generator (facebook/bart-large is not on "
                                           "this machine)"})  # fmt: skip
    (line,) = tpu_table.train_rows(bart, steps=1)
    assert "| replicated | on |" in line


def test_a_remat_policy_other_than_full_tells_compiles_apart():
    full = {"target": TARGET, "train": [dict(_row(128, 14 * GIB), remat_policy="full")],
            "generate": []}  # fmt: skip
    policy = dict(_row(256, 15 * GIB), attention_impl="splash", remat_policy="projections")
    splash = {"target": TARGET, "train": [policy], "generate": []}
    assert tpu_table.largest_rows([full, splash]) == []  # two settings, one compile each
    (line,) = tpu_table.train_rows(splash, steps=1)
    assert "| replicated, splash attention, remat policy projections | on |" in line
    (line,) = tpu_table.train_rows(full, steps=1)
    assert "| replicated | on |" in line


def test_main_prints_the_tables(tmp_path, capsys):
    largest = {"rows": [{"batch": 64, "needed_bytes": 12 * GIB, "fits": True}]}
    report = {"target": TARGET, "train": [_row(128, 14 * GIB, largest=largest)], "generate": []}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    tpu_table.main([str(path)])
    out = capsys.readouterr().out
    assert out.count("| v5litepod-8") == 2  # the compile, and the largest-batch row
    assert "| 64: 12.00, 128: 14.00 | 128 (16) | 192 (24) | 0.25 |" in out


@pytest.mark.parametrize("kind,chips,name", [("TPU v4", 4, "v4-8"), ("TPU v6 lite", 8, "v6e-8")])
def test_slice_names_count_cores_on_v4_and_chips_on_v6e(kind, chips, name):
    t = dict(TARGET, kind=kind, chips=chips, topology="x")
    assert tpu_table._slice(t).startswith(f"{name} (x, 1 host)")
