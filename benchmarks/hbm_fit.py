"""Whether a compiled program fits a chip's HBM, and what would: the largest batch that fits,
found from a few compiles, and advice for a program that does not.

Both read the rows `benchmarks.aot` reports for each compile: a row has "batch", "fits" and the
memory needed per chip ("memory"["total"], or "needed_bytes" when the compiler refused it), and
`advice` reads its "arguments" (the parts known before compiling). No compiler is needed here.

Legend: B global batch, n chips.
"""

import math

from benchmarks.tpu_topology import Target
from rag_jax.devices.device_memory import human_bytes


def needed_bytes(row: dict) -> int | None:
    """The bytes per chip a row's program needs, compiled or refused (None if unknown)."""
    return row["memory"]["total"] if "memory" in row else row.get("needed_bytes")


def largest_batch(measure, chips: int, hbm: int, probes: tuple[int, int], max_tries: int = 4):
    """The largest global batch (a multiple of `chips`) whose program fits in `hbm` per chip.

    Memory is close to linear in the batch: the two measured batches nearest the limit give
    fixed + per-example bytes, which predict the largest batch; it is compiled, and so is the
    next multiple of `chips`, until a batch that fits sits next to one that does not (at most
    `max_tries` compiles after the `probes`; `proved` says whether that was reached).

    Args:
      measure: `measure(batch) -> row` (`train_row` / `generate_row`); a row has "fits" and the
        memory needed ("memory"["total"], or "needed_bytes" when the compiler refused it).

    Returns:
      {"batch", "per_chip", "proved", "bytes_per_example", "fixed_bytes", "rows"}, "batch" None
      when not even `chips` examples fit.
    """
    rows = {b: measure(b) for b in sorted(set(probes))}
    model = {}

    def bounds():
        fit = [b for b, r in rows.items() if r["fits"]]
        lo = max(fit, default=0)
        return lo, min((b for b, r in rows.items() if not r["fits"] and b > lo), default=None)

    def predict():
        points = sorted((b, needed_bytes(r)) for b, r in rows.items() if needed_bytes(r))
        under = [pt for pt in points if pt[1] <= hbm]
        over = [pt for pt in points if pt[1] > hbm]
        pair = (under[-1], over[0]) if under and over else tuple(points[-2:])
        if len(pair) < 2 or pair[1][0] == pair[0][0]:
            return None
        (b1, m1), (b2, m2) = pair
        slope = (m2 - m1) / (b2 - b1)  # bytes per chip per global example
        if slope <= 0:
            return None
        model.update(bytes_per_example=slope * chips, fixed_bytes=m1 - slope * b1)
        return int((hbm - m1) / slope + b1) // chips * chips

    for _ in range(max_tries):
        lo, hi = bounds()
        if hi is not None and hi - lo <= chips:
            break
        guess = predict()
        if guess is None or guess <= lo:
            guess = lo + chips if hi is not None or guess is not None else max(2 * lo, chips)
        if hi is not None and guess >= hi:
            guess = hi - chips
        if guess in rows:
            break
        rows[guess] = measure(guess)
    lo, hi = bounds()
    return {"batch": lo or None, "per_chip": (lo // chips) if lo else None,
            "proved": hi is not None and hi - lo <= chips, **model,
            "rows": [_brief(rows[b]) for b in sorted(rows)]}  # fmt: skip


def _brief(row: dict) -> dict:
    return {
        "batch": row["batch"],
        "fits": row["fits"],
        "needed_bytes": needed_bytes(row),
        "compile_s": round(row["compile_s"], 1),
    }


def advice(row: dict, t: Target, others: list[dict]) -> dict:
    """For a program that does not fit: which part is over, by how much, and what would fit
    (another setting, a smaller batch, more chips), from this row and `others` (the same program
    compiled in other settings)."""
    need, hbm, args = needed_bytes(row), t.hbm_bytes, row["arguments"]
    parts = {k: v for k, v in row.get("memory", args).items() if k != "total"}
    fixed = sum(v for k, v in args.items() if k != "batch")  # independent of the batch
    out = {"needed_bytes": need, "hbm_bytes": hbm, "over_by_bytes": need - hbm,
           "largest_part": max(parts, key=parts.get), "batch_independent_bytes": fixed,
           "fits_with": []}  # fmt: skip
    keys = ("remat", "param_sharding", "index")
    for other in [*others, row]:
        changed = {k: other[k] for k in keys if k in other and other[k] != row.get(k)}
        if other.get("fits") and other is not row:
            out["fits_with"].append({**changed, "batch": other["batch"]})
        if (other.get("largest") or {}).get("batch"):
            out["fits_with"].append({**changed, "batch": other["largest"]["batch"]})
    if fixed >= hbm:  # no batch fits: what does not shrink with the batch must split
        split = args.get("index shard", 0)
        if row.get("param_sharding") == "fsdp":
            split += args["parameters"] + args.get("optimizer state", 0)
        room = hbm - (fixed - split)  # the rest of the fixed parts stay whole on every chip
        if room > 0 and split:
            out["chips_needed_at_least"] = math.ceil(split * t.chips / room)
        out["why"] = (
            f"the parts independent of the batch need {human_bytes(fixed)} ("
            + ", ".join(f"{k} {human_bytes(v)}" for k, v in args.items() if k != "batch")
            + f"), more than the {human_bytes(hbm)} of HBM per chip"
        )
    return out
