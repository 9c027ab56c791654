"""The GPU round's figures against issue 46's goals, from the reports bench/gpu_round.sh leaves in one folder.

    python3 bench/gpu_round_summary.py OUT_DIR      # engine_throughput.json, kernel_bandwidth.json in OUT_DIR

One line per goal: the figure, the goal, and ``met``, ``MISSED`` or ``n/a`` (its report or row is absent: the
step failed or ran out of time, and the log says why). Goals that depend on the device are taken for the
device the report names (H200, else the H100's); MBU is against that device's datasheet peak.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"device": "?", "results": []}


def verdict(figure: float | None, goal: float, at_most: bool = False) -> str:
    if figure is None:
        return "n/a"
    return "met" if (figure <= goal if at_most else figure >= goal) else "MISSED"


def line(what: str, figure: float | None, goal: float, unit: str = "", at_most: bool = False) -> str:
    shown = "-" if figure is None else f"{figure:,.3f}" if figure < 10 else f"{figure:,.0f}"
    return f"{what:<64}{shown + unit:>14}  goal {'<=' if at_most else '>='} {goal:,}{unit:<4} {verdict(figure, goal, at_most)}"


def engine_lines(report: dict) -> list[str]:
    h200 = "H200" in report["device"]
    rows = {row["model"]: row for row in report["results"]}
    qwen, llama8 = rows.get("qwen2.5-0.5b", {}), rows.get("llama-3.1-8b", {})
    decode = (qwen.get("phases") or {}).get("decode_batch_ge_64") or {}
    lines = [
        line("Qwen2.5-0.5B shape, output tok/s as shipped", qwen.get("engine_tokens_per_s"), 45000 if h200 else 40000),
        line("Qwen2.5-0.5B shape, ratio to transformers", qwen.get("ratio"), 20, "x"),
        line("Qwen2.5-0.5B shape, decode MBU at batch >= 64", qwen.get("decode_mbu_batch_ge_64"), 0.35),
        line("Llama-3.1-8B shape, decode MBU at batch 64", llama8.get("decode_mbu_batch_ge_64"), 0.70),
        line("batch-256 decode step, device ms (kernel profile, eager)", qwen.get("kernel_ms_per_step"),
             1.5 if h200 else 1.8, " ms", at_most=True),
        line("decode step at batch >= 64, host ms (phases)", decode.get("host_ms"), 1.0, " ms", at_most=True),
    ]
    for name, row in rows.items():
        shipped = "on" if row["async_scheduling"] else "off"
        mbu = row["decode_mbu_batch_ge_64"]
        parts = [f"{name}: {row['engine_tokens_per_s']:,.0f} tok/s as shipped (async_scheduling {shipped}), MBU b>=64 {mbu}"]
        if "other_scheduling" in row:
            other = row["other_scheduling"]
            parts.append(f"other scheduling {other['engine_tokens_per_s']:,.0f} tok/s; faster: async_scheduling "
                         f"{'on' if row['faster_async_scheduling'] else 'off'} (on/off {row['async_speedup']:.3f})")
        if "unfused" in row:
            parts.append(f"unfused {row['unfused']['engine_tokens_per_s']:,.0f} tok/s, "
                         f"{row['unfused']['identical_requests']} requests same tokens ({row['dtype']})")
        if "fusion_fp32" in row:
            check = row["fusion_fp32"]
            parts.append(f"fp32 fused vs unfused: {check['identical_requests']}/{check['requests']} identical"
                         if "identical_requests" in check else f"fp32 fused vs unfused: {check}")
        if row.get("hf_tokens_per_s") is not None:
            parts.append(f"transformers {row['hf_tokens_per_s']:,.0f} tok/s on {row['hf_requests']} requests")
        lines.append("; ".join(parts))
    return lines


def kernel_lines(report: dict) -> list[str]:
    engine = [r for r in report["results"] if r.get("engine_tile")]
    grid = [r["of_copy"] for r in engine if r["batch"] >= 64 and r["context"] >= 2048 and not r.get("workload_cell")]
    cell = [r["of_copy"] for r in engine if r.get("workload_cell")]
    known = [f for f in grid if f is not None]
    lines = [line("decode kernel / copy, worst cell at batch >= 64, context >= 2048",
                  min(known) if known and len(known) == len(grid) else None, 0.80),
             line("decode kernel / copy, the workload's cell (worst shape)",
                  min(cell) if cell and None not in cell else None, 0.60)]
    for r in engine:
        lines.append(f"  {r['shape']:<14} batch {r['batch']:>4} context {r['context']:>5}: "
                     + (f"{r['of_copy']:.0%} of copy in a graph" if r["of_copy"] is not None else "graph failed")
                     + f", {r['eager_of_copy']:.0%} eager")
    return lines


def main(folder: Path) -> None:
    engine, kernels = load(folder / "engine_throughput.json"), load(folder / "kernel_bandwidth.json")
    print(f"device: {engine['device']} (engine), {kernels['device']} (kernels)")
    print("\n".join(engine_lines(engine) + kernel_lines(kernels)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
