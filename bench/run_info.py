"""What a benchmark ran on, printed at the top of every report so a figure never travels without it, and
``write_report``, which writes every benchmark's raw report."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
from pathlib import Path

import torch


def cpu_name() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    return names[0] if names else platform.machine()


def describe(device: torch.device) -> str:
    host = f"{cpu_name()}, {os.cpu_count()} cores"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
        host = f"{gpu}; host {host}; CUDA {torch.version.cuda}"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return (
        f"{host}; Python {platform.python_version()}, torch {torch.__version__}, triton {triton_version}"
        f"{', TRITON_INTERPRET=1' if os.environ.get('TRITON_INTERPRET') == '1' else ''}"
    )


def command() -> str:
    """The command line that produced the report, as it could be pasted back into a shell."""
    return shlex.join([os.path.relpath(sys.executable), *sys.argv])


def print_preamble(device: torch.device, smoke: bool, cpu_run: str | None = None) -> None:
    """The lines a printed report starts with: the machine, the command, and what makes its figures
    meaningless, if anything: ``--smoke`` sizes, or (``cpu_run``, for a GPU benchmark) a CPU."""
    print(f"machine: {describe(device)}")
    print(f"command: {command()}")
    if smoke:
        print("SMOKE RUN: toy sizes, not a performance figure")
    if cpu_run is not None and device.type != "cuda":
        print(f"CPU RUN: {cpu_run}")


def device_report(device: torch.device, results: list[dict], **fields: object) -> dict:
    """The report of an engine benchmark: ``device`` (``torch.cuda.get_device_name()``, else the CPU's name),
    the machine and command lines the printed report starts with, ``fields``, then ``results``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"device": name, "machine": describe(device), "command": command(), **fields, "results": results}


def side_by_side_report(report: dict) -> dict:
    """A side-by-side benchmark's report (``machine``, ``command``, ``summary`` by workload, the rest) as the
    CPU benchmarks' raw report: one result row per workload of its summary, the rest as fields."""
    fields = {key: value for key, value in report.items() if key not in ("machine", "command", "summary")}
    rows = [{"workload": load, **row} for load, row in report["summary"].items()]
    return device_report(torch.device("cpu"), rows, **fields)


def write_report(path: Path, report: dict, *, table_rows_on_one_line: bool = False) -> None:
    """Write a benchmark's raw report to ``path`` as indented JSON, atomically: the one writer of every benchmark.

    ``table_rows_on_one_line``: each row of a table (a list of lists) takes one line, so that long timelines
    stay small enough to commit and still read as tables."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = _rows_on_one_line(report, "") if table_rows_on_one_line else json.dumps(report, indent=2)
    # Whole or not at all: a run killed at its time limit mid-write keeps the report it had (bench/gpu_round.sh
    # rewrites one report after every part of a run).
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text + "\n")
    partial.replace(path)


def _rows_on_one_line(value: object, pad: str) -> str:
    inner = pad + " "
    if isinstance(value, dict) and value:
        items = (f"{inner}{json.dumps(key)}: {_rows_on_one_line(item, inner)}" for key, item in value.items())
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
        return "[\n" + ",\n".join(inner + json.dumps(row) for row in value) + "\n" + pad + "]"
    return json.dumps(value)
