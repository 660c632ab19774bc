"""From every rank's raw numbers to the rows, the targets, the tables and the plot.

A row is one (model size, world size N, mode) on gloo:

- ``step``: the median over timed steps of the step's time, where a step's time is
  the slowest rank's (ranks start each timed step together, after a barrier);
  ``step_min``/``step_max`` are the spread; ``tokens_per_s`` = global tokens per
  step / median step.
- ``cpu``: CPU seconds per step per rank, all threads (less sensitive than wall
  time to other processes on the machine).
- ``exposed``: ``(step - fake_step) / step``, with ``fake_step`` the median step of
  the same run on the fake backend (collectives are no-ops): the share of the
  step spent waiting for communication that compute did not hide.
- ``peak``/``state``: the largest rank's peak and between-step memory above its
  baseline (Note [memory in use] in `probes.py`); ``floor`` from `reference.py`.
- ``payload``: collective payload bytes per rank in the instrumented step, by
  kind, and ``counts``; ``ring``: what a ring algorithm puts on the wire for that
  payload (``(N-1)/N`` of all-gathers, reduce-scatters and broadcasts, ``2(N-1)/N``
  of all-reduces); ``wire``: measured bytes sent per rank per step (Note [bytes on
  the wire]); ``gloo_extra`` = ``wire - ring``.
- ``loss``: the last step's loss (mean over ranks); ``loss_diff``: its relative
  difference from the one-process run of the same size and global batch (None where the batch differs).
"""

from __future__ import annotations

import statistics
from pathlib import Path

MiB = 2**20
RING = {"all_gather": "gather", "reduce_scatter": "gather", "broadcast": "gather", "all_to_all": "gather",
        "all_reduce": "reduce"}
LOSS_TOLERANCE = 1e-4  # relative; float32 with AdamW, a few steps (see docs/benchmarks.md)
# The targets (docs/benchmarks.md, "Where the targets stand"): step-time ratios, throughput gains, the exposed share.
ZERO3_VS_FSDP2 = 0.70
SINGLE_SLACK = 1.03
INDUCTOR_VS_FSDP2 = 1.6
INDUCTOR_VS_FSDP2_COMPILE = 1.15
EXPOSED_CEILING = 0.15


def _ring(kind: str, payload: int, n: int) -> float:
    factor = {"gather": (n - 1) / n, "reduce": 2 * (n - 1) / n}.get(RING.get(kind, ""), 1.0)
    return payload * factor


def aggregate(results: dict) -> dict:
    """Rows for every gloo run, plus the target checks (see the module docstring)."""
    runs = results["runs"]
    fake = {(r["size"], r["world"], r["mode"]): _median_step(r) for r in runs if r["backend"] == "fake"}
    singles = {r["size"]: _loss(r) for r in runs if r["backend"] == "gloo" and r["mode"] == "single"}
    rows = []
    for run in (r for r in runs if r["backend"] == "gloo"):
        size, n, mode, ranks = run["size"], run["world"], run["mode"], run["ranks"]
        ref = results["sizes"][size]["reference"][str(n)]
        cfg = results["sizes"][size]["config"]
        step_times = [max(r["times"][k] for r in ranks) for k in range(len(ranks[0]["times"]))]
        step = statistics.median(step_times)
        payload = ranks[0]["payload"]
        ring = {k: _ring(k, v, n) for k, v in payload.items()}
        wire = statistics.median(statistics.mean(r["wire"][k] for r in ranks) for k in range(len(step_times)))
        peak = max(r["peak"] for r in ranks)
        row = {
            "size": size, "world": n, "mode": mode,
            "step": step, "step_min": min(step_times), "step_max": max(step_times),
            "tokens_per_s": _global_batch(results, cfg, n) * cfg["seq_len"] / step,
            "cpu": statistics.median(statistics.mean(r["cpu"][k] for r in ranks) for k in range(len(step_times))),
            "fake_step": fake.get((size, n, mode)),
            "peak": peak, "state": max(r["state"] for r in ranks), "floor": ref["floor"],
            "peak_over_floor": peak / ref["floor"],
            "counts": ranks[0]["counts"], "payload": payload, "payload_total": sum(payload.values()),
            "payload_over_M": sum(payload.values()) / ref["M"], "ring": ring, "ring_total": sum(ring.values()),
            "wire": wire, "gloo_extra": wire - sum(ring.values()),
            # One process ran at N = 1: its loss is this run's only where both trained on the same global batch
            # (not so in the latency setting, whose batch grows with N).
            "loss": _loss(run), "loss_diff": (_rel(_loss(run), singles.get(size))
                                              if _global_batch(results, cfg, n) == _global_batch(results, cfg, 1)
                                              else None),
            "startup_s": max(r["build_s"] + r.get("first_step_s", 0.0) for r in ranks),
            "same_on_every_rank": all(r["counts"] == ranks[0]["counts"] and r["payload"] == payload for r in ranks),
        }
        row["exposed"] = None if row["fake_step"] is None else (step - row["fake_step"]) / step
        if "schedule_payload" in ranks[0]:
            predicted = ranks[0]["schedule_payload"]
            row["schedule_payload"] = predicted
            row["M_padded"] = ranks[0]["M_padded"]
            row["R"] = predicted.get("all_gather", 0) - ranks[0]["M_padded"]
            row["compile_s"] = ranks[0]["compile_s"]
            row["payload_vs_schedule"] = (sum(payload.values()) / max(sum(predicted.values()), 1)) - 1
        rows.append(row)
    return {"rows": rows, "targets": _targets(rows, results)}


def _global_batch(results: dict, cfg: dict, n: int) -> int:
    per_rank = cfg.get("per_rank_batch")
    return results["settings"]["global_batch"] if per_rank is None else per_rank * n


def _median_step(run: dict) -> float:
    ranks = run["ranks"]
    return statistics.median(max(r["times"][k] for r in ranks) for k in range(len(ranks[0]["times"])))


def _loss(run: dict) -> float:
    return statistics.mean(r["loss"] for r in run["ranks"])


def _rel(a: float, b: float | None) -> float | None:
    return None if b is None else abs(a - b) / max(abs(b), 1e-30)


def _find(rows, size, world, mode):
    return next((r for r in rows if (r["size"], r["world"], r["mode"]) == (size, world, mode)), None)


def _targets(rows: list[dict], results: dict) -> list[dict]:
    """The issue's targets, in its order of priority, each with its numbers and met / missed / not run."""
    out = []
    sizes = results["settings"]["sizes"]
    big = "100M" if "100M" in sizes else sizes[-1]

    for size in sizes:
        for row in (r for r in rows if r["size"] == size and r["mode"] == "shardlang"):
            peers = [p for p in (_find(rows, size, row["world"], m) for m in ("fsdp2", "ddp")) if p]
            diffs = {p["mode"]: _rel(row["loss"], p["loss"]) for p in peers}
            met = all(d <= LOSS_TOLERANCE for d in diffs.values()) and (row["loss_diff"] or 0) <= LOSS_TOLERANCE
            out.append({"target": "loss matches FSDP2 and DDP", "size": size, "world": row["world"], "met": met,
                        "detail": ", ".join(f"vs {m} {d:.1e}" for m, d in diffs.items())
                        + (f", vs one process {row['loss_diff']:.1e}" if row["loss_diff"] is not None else "")
                        + f" (tolerance {LOSS_TOLERANCE:.0e} relative)"})

    for n in (w for w in results["settings"]["world_sizes"] if w > 1):
        ours, fsdp = _find(rows, big, n, "shardlang"), _find(rows, big, n, "fsdp2")
        if ours and fsdp:
            out.append({"target": "peak memory <= FSDP2's", "size": big, "world": n,
                        "met": ours["peak"] <= fsdp["peak"],
                        "detail": f"shardlang {ours['peak'] / MiB:.0f} MiB ({ours['peak_over_floor']:.2f}x floor), "
                                  f"FSDP2 {fsdp['peak'] / MiB:.0f} MiB ({fsdp['peak_over_floor']:.2f}x floor), "
                                  f"floor {ours['floor'] / MiB:.0f} MiB"})

    for row in (r for r in rows if r["mode"] in ("shardlang", "shardlang-inductor") and r["world"] > 1):
        pay = row["payload"]
        # on gloo shardlang's reduce-scatter is an all-to-all plus a local sum (Note [reduce-scatter as all-to-all])
        ag, rs = pay.get("all_gather", 0), pay.get("reduce_scatter", 0) + pay.get("all_to_all", 0)
        m = row["M_padded"]
        out.append({"target": f"{row['mode']} bytes = the schedule's formula (within 1%)", "size": row["size"],
                    "world": row["world"],
                    "met": abs(row["payload_vs_schedule"]) <= 0.01,
                    "detail": f"payload {row['payload_total'] / MiB:.1f} MiB = all-gather {ag / m:.2f} M + "
                              f"reduce-scatter {rs / m:.2f} M (formula M + R + M = {(2 * m + row['R']) / m:.2f} M, "
                              f"off by {row['payload_vs_schedule']:+.2%}; textbook 3 M); ring wire "
                              f"{row['ring_total'] / MiB:.1f} MiB, measured {row['wire'] / MiB:.1f} MiB "
                              f"(gloo adds {row['gloo_extra'] / MiB:.1f} MiB)"})

    worlds = [w for w in results["settings"]["world_sizes"] if w > 1]
    for size in sizes:
        for n in worlds:
            ours, fsdp = _find(rows, size, n, "shardlang"), _find(rows, size, n, "fsdp2")
            if ours and fsdp:
                ratio = ours["step"] / fsdp["step"]
                out.append({"target": f"eager ZeRO-3 step <= {ZERO3_VS_FSDP2}x FSDP2's", "size": size, "world": n,
                            "met": ratio <= ZERO3_VS_FSDP2,
                            "detail": f"ratio {ratio:.3f} ({_ms(ours['step'])} vs {_ms(fsdp['step'])}); "
                                      f"CPU time ratio {ours['cpu'] / fsdp['cpu']:.3f}"})
            ddp = _find(rows, size, n, "ddp")
            for mode in ("shardlang-zero2", "shardlang-zero1", "shardlang-ddp"):
                row = _find(rows, size, n, mode)
                if row and ddp:
                    ratio = row["step"] / ddp["step"]
                    out.append({"target": f"{mode} step <= torch DDP's", "size": size, "world": n, "met": ratio <= 1.0,
                                "detail": f"ratio {ratio:.3f} ({_ms(row['step'])} vs {_ms(ddp['step'])}); "
                                          f"CPU time ratio {row['cpu'] / ddp['cpu']:.3f}"})
            compiled = _find(rows, size, n, "shardlang-inductor")
            for peer, aim in (("fsdp2", INDUCTOR_VS_FSDP2), ("fsdp2-compile", INDUCTOR_VS_FSDP2_COMPILE)):
                other = _find(rows, size, n, peer)
                if compiled and other:
                    gain = compiled["tokens_per_s"] / other["tokens_per_s"]
                    out.append({"target": f"inductor throughput >= {aim}x {peer}'s", "size": size, "world": n,
                                "met": gain >= aim,
                                "detail": f"{gain:.2f}x ({compiled['tokens_per_s']:.0f} vs "
                                          f"{other['tokens_per_s']:.0f} tokens/s; step {_ms(compiled['step'])} vs "
                                          f"{_ms(other['step'])})"})
        single = _find(rows, size, 1, "single")
        ours = _find(rows, size, 1, "shardlang")
        if ours and single:
            ratio = ours["step"] / single["step"]
            out.append({"target": f"N=1 step <= {SINGLE_SLACK}x one process", "size": size, "world": 1,
                        "met": ratio <= SINGLE_SLACK,
                        "detail": f"ratio {ratio:.3f} ({_ms(ours['step'])} vs {_ms(single['step'])}); "
                                  f"CPU time ratio {ours['cpu'] / single['cpu']:.3f} "
                                  f"({ours['cpu']:.2f} s vs {single['cpu']:.2f} s)"})
        compiled = _find(rows, size, 1, "shardlang-inductor")
        if compiled and single:
            ratio = compiled["step"] / single["step"]
            out.append({"target": "N=1 inductor step < one eager process's", "size": size, "world": 1,
                        "met": ratio < 1.0, "detail": f"ratio {ratio:.3f} ({_ms(compiled['step'])} vs "
                                                      f"{_ms(single['step'])})"})
        for mode in ("shardlang", "shardlang-inductor"):
            row = _find(rows, size, 2, mode)
            if row and row["exposed"] is not None:
                out.append({"target": f"{mode} exposed communication <= {EXPOSED_CEILING:.0%} at N=2", "size": size,
                            "world": 2, "met": row["exposed"] <= EXPOSED_CEILING,
                            "detail": f"{row['exposed']:.0%} ({_ms(row['step'])} on gloo, "
                                      f"{_ms(row['fake_step'])} with no-op collectives)"})
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _mib(b: float) -> str:
    return f"{b / MiB:.1f}"


def _kinds(d: dict, scale=MiB) -> str:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC", "all_to_all": "A2A"}
    return " ".join(f"{short.get(k, k)} {v / scale:.1f}" if scale != 1 else f"{short.get(k, k)} {v}"
                    for k, v in sorted(d.items())) or "-"


def render_markdown(results: dict) -> str:
    """The time table, the memory and communication table, and the targets, as Markdown."""
    rows = results["summary"]["rows"]
    lines = ["## Time", "",
             "| model | N | mode | step (median) | spread (min-max) | tokens/s | CPU s/step/rank | exposed comm "
             "| build + first step | loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        exposed = "-" if r["exposed"] is None else f"{r['exposed']:.0%}"
        lines.append(f"| {r['size']} | {r['world']} | {r['mode']} | {_ms(r['step'])} | "
                     f"{_ms(r['step_min'])}-{_ms(r['step_max'])} | {r['tokens_per_s']:.0f} | {r['cpu']:.2f} | "
                     f"{exposed} | {r['startup_s']:.1f} s | {r['loss']:.6f} |")
    lines += ["", "## Memory and communication per rank per step", "",
              "| model | N | mode | peak MiB | peak / floor | state MiB | collectives | payload MiB | "
              "payload / M | ring wire MiB | measured wire MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['world']} | {r['mode']} | {_mib(r['peak'])} | {r['peak_over_floor']:.2f} | "
                     f"{_mib(r['state'])} | {_kinds(r['counts'], 1)} | {_kinds(r['payload'])} | "
                     f"{r['payload_over_M']:.2f} | {_mib(r['ring_total'])} | {_mib(r['wire'])} |")
    lines += ["", "## Reference figures", "", "| model | params | M MiB | largest unit MiB | N | activations MiB | "
              "floor MiB |", "|---|---|---|---|---|---|---|"]
    for size, info in results["sizes"].items():
        for n, ref in info["reference"].items():
            lines.append(f"| {size} | {ref['params']:,} | {_mib(ref['M'])} | {_mib(ref['largest_unit'])} | {n} | "
                         f"{_mib(ref['activations'])} | {_mib(ref['floor'])} |")
    lines += ["", "## Targets", ""]
    for t in results["summary"]["targets"]:
        lines.append(f"- {'MET' if t['met'] else 'MISSED'}: {t['target']}, {t['size']} N={t['world']}: {t['detail']}")
    m = results["machine"]
    commit = f"; shardlang at {m['commit']}" if m.get("commit") else ""
    if not results["settings"].get("prime", True):
        lines += ["", "Not primed (--no-prime or --quick): the first mode built in each pool is charged the one-time "
                      "imports and caches (tens of MiB) in its state and peak."]
    lines += ["", f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, "
              f"Python {m['python']}{commit}; load average at start {m['loadavg_start'][0]:.2f}. "
              f"Command: `{results['command']}` ({results['wall_s']} s).", ""]
    return "\n".join(lines)


def write_plot(results: dict, path: Path) -> Path | None:
    """Step time and peak memory per rank against N, one line per mode, one column per size; None without
    matplotlib (it is optional: ``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    rows = results["summary"]["rows"]
    sizes = results["settings"]["sizes"]
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.5 * len(sizes), 8), squeeze=False)
    for col, size in enumerate(sizes):
        mine = [r for r in rows if r["size"] == size]
        worlds = sorted({r["world"] for r in mine})
        for mode in dict.fromkeys(r["mode"] for r in mine):
            pts = sorted((r for r in mine if r["mode"] == mode), key=lambda r: r["world"])
            xs = [r["world"] for r in pts]
            style = {"marker": "o" if mode != "single" else "*", "markersize": 6 if mode != "single" else 12}
            spread = [[r["step"] - r["step_min"] for r in pts], [r["step_max"] - r["step"] for r in pts]]
            axes[0][col].errorbar(xs, [r["step"] for r in pts], yerr=spread, label=mode, capsize=3, **style)
            axes[1][col].plot(xs, [r["peak"] / MiB for r in pts], label=mode, **style)
        floors = [results["sizes"][size]["reference"][str(n)]["floor"] / MiB for n in worlds]
        axes[1][col].plot(worlds, floors, "k--", label="floor 16P/N + unit + activations")
        axes[0][col].set_title(f"GPT {size}: step time (median, min-max)")
        axes[1][col].set_title(f"GPT {size}: peak memory per rank")
        axes[0][col].set_ylabel("seconds")
        axes[1][col].set_ylabel("MiB above baseline")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("ranks N (gloo, 1 thread each)")
            ax.set_xticks(worlds)
            ax.grid(alpha=0.3)
    handles, labels = axes[1][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
