"""The fit table of tpu/README.md from `experiments/tpu_compile.py` reports.

    python -m benchmarks.tpu_table tpu/compile_reports/*.json

One markdown row per compiled train step: the topology, layout, remat and index path, the memory
per chip against HBM, the largest batch found, the roofline step time and the model-FLOPs
utilisation it caps, and the hours and on-demand cost of the paper's NQ schedule (`--steps`
steps at the config's batch) at the roofline: a floor, since a real step is slower. Then one
row per generation program.
"""

import argparse
import json
import pathlib

# On-demand price per chip-hour, US regions (cloud.google.com/tpu/pricing, as listed in 2025 in
# tpu/README.md; not re-checked here, and they differ by region).
PRICES = {"TPU v4": 3.22, "TPU v5 lite": 1.20, "TPU v5": 4.20, "TPU v6 lite": 2.70}
SLICES = {"TPU v4": "v4-{}", "TPU v5 lite": "v5litepod-{}", "TPU v5": "v5p-{}",
          "TPU v6 lite": "v6e-{}"}  # fmt: skip


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _slice(target: dict) -> str:
    # v4 and v5p slices are named by TensorCores (2 per chip), v5e and v6e by chips.
    cores = 2 if target["kind"] in ("TPU v4", "TPU v5") else 1
    name = SLICES.get(target["kind"], "{}").format(target["chips"] * cores)
    return f"{name} ({target['topology']}, {target['hosts']} host{'s' * (target['hosts'] > 1)})"


def _setting(report: dict, row: dict) -> str:
    """What besides the slice and the batch tells compiles apart: the parameter layout, the
    attention and optimizer implementations when not XLA's and optax's and the remat policy when
    not "full" (reports from before they were recorded used those), and the generator when it
    is not the config's BART."""
    parts = [row["param_sharding"]]
    if row.get("attention_impl", "xla") != "xla":
        parts.append(f"{row['attention_impl']} attention")
    if row.get("optimizer_impl", "optax") != "optax":
        parts.append(f"{row['optimizer_impl']} AdamW")
    if row["remat"] and row.get("remat_policy", "full") != "full":
        parts.append(f"remat policy {row['remat_policy']}")
    generator = str((report.get("models") or {}).get("generator", ""))
    if generator and not generator.startswith("config.model.generator "):
        parts.append(pathlib.PurePath(generator.split(" ")[0]).name)
    return ", ".join(parts)


def train_rows(report: dict, steps: int) -> list[str]:
    t = report["target"]
    out = []
    for row in report["train"]:
        need = row["memory"]["total"] if "memory" in row else row.get("needed_bytes")
        fits = "yes" if row["fits"] else f"no (+{_gib(need - t['hbm_bytes_per_chip'])})"
        largest = row.get("largest") or {}
        best = "-"
        if largest.get("batch"):
            best = f"{largest['batch']} ({largest['per_chip']})" + (
                "" if largest["proved"] else "?"
            )
        elif largest:
            best = "none"
        roof = row.get("roofline")
        step = f"{roof['step_s'] * 1e3:.0f} ({roof['bound'][:3]})" if roof else "-"
        mfu = f"{roof['mfu_ceiling']:.0%}" if roof else "-"
        hours = roof["step_s"] * steps / 3600 if roof else None
        price = PRICES.get(t["kind"])
        cost = f"${hours * t['chips'] * price:.2f}" if hours and price else "-"
        out.append(
            f"| {_slice(t)} | {_setting(report, row)} | {'on' if row['remat'] else 'off'} "
            f"| {row['index']} | {row['batch']} ({row['per_chip_batch']}) | {_gib(need)} "
            f"/ {_gib(t['hbm_bytes_per_chip'])} | {fits} | {best} | {step} | {mfu} "
            f"| {'-' if hours is None else f'{hours:.2f}'} | {cost} |"
        )
    return out


def largest_rows(reports: list[dict]) -> list[str]:
    """One row per program setting compiled at several batches (in one report or several): the
    largest compiled batch that fits, and the largest the line through the two compiles nearest
    the limit predicts (memory per chip is close to linear in the batch), which is a prediction
    until a compile at it fits."""
    groups = {}
    for report in reports:
        t = report["target"]
        for row in report["train"]:
            key = (t["topology"], _setting(report, row), row["remat"], row["index"])
            points = groups.setdefault(key, (t, {}))[1]
            need = row["memory"]["total"] if "memory" in row else row.get("needed_bytes")
            points[row["batch"]] = (need, row["fits"])
            for brief in (row.get("largest") or {}).get("rows", []):
                points[brief["batch"]] = (brief["needed_bytes"], brief["fits"])
    out = []
    for (_, layout, remat, index), (t, points) in groups.items():
        if len(points) < 2:
            continue
        hbm, chips = t["hbm_bytes_per_chip"], t["chips"]
        known = sorted((b, need) for b, (need, _) in points.items() if need)
        under = [pt for pt in known if pt[1] <= hbm]
        over = [pt for pt in known if pt[1] > hbm]
        (b1, m1), (b2, m2) = (under[-1], over[0]) if under and over else known[-2:]
        slope = (m2 - m1) / (b2 - b1)  # bytes per chip per global example
        predicted = int((hbm - m1) / slope + b1) // chips * chips if slope > 0 else None
        fits = max((b for b, (_, ok) in points.items() if ok), default=None)
        compiled = ", ".join(f"{b}: {_gib(points[b][0])}" for b in sorted(points))
        out.append(
            f"| {_slice(t)} | {layout} | {'on' if remat else 'off'} | {index} | {compiled} "
            f"| {'none' if fits is None else f'{fits} ({fits // chips})'} "
            f"| {'-' if predicted is None else f'{predicted} ({predicted // chips})'} "
            f"| {_gib(slope * chips)} |"
        )
    return out


def generate_rows(report: dict) -> list[str]:
    t = report["target"]
    out = []
    for row in report["generate"]:
        need = row["memory"]["total"] if "memory" in row else row.get("needed_bytes")
        largest = row.get("largest") or {}
        best = f"{largest['batch']} ({largest['per_chip']})" if largest.get("batch") else "-"
        out.append(
            f"| {_slice(t)} | {row['program']} | {row['n_docs']} | {row['num_beams']} "
            f"| {row['batch']} ({row['per_chip_batch']}) | {_gib(need)} "
            f"/ {_gib(t['hbm_bytes_per_chip'])} | {'yes' if row['fits'] else 'no'} | {best} |"
        )
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="JSON reports of experiments/tpu_compile.py")
    p.add_argument("--steps", type=int, default=7000, help="the schedule's steps (nq.py: 7000)")
    args = p.parse_args(argv)
    reports = [json.load(open(path, encoding="utf-8")) for path in args.reports]
    print(
        "| slice | parameters | remat | index | B (per chip) | GiB per chip / HBM | fits "
        "| largest B (per chip) | roofline ms | MFU ceiling | hours | on-demand cost |"
    )
    print("| --- " * 12 + "|")
    for report in reports:
        print("\n".join(train_rows(report, args.steps)))
    largest = largest_rows(reports)
    if largest:
        print()
        print("| slice | parameters | remat | index | compiled B: GiB per chip | largest B "
              "compiled that fits (per chip) | largest B predicted (per chip) "
              "| GiB per example on a chip |")  # fmt: skip
        print("| --- " * 8 + "|")
        print("\n".join(largest))
    generation = [line for report in reports for line in generate_rows(report)]
    if generation:
        print()
        print("| slice | program | N | beams | B (per chip) | GiB per chip / HBM | fits "
              "| largest B (per chip) |")  # fmt: skip
        print("| --- " * 8 + "|")
        print("\n".join(generation))


if __name__ == "__main__":
    main()
