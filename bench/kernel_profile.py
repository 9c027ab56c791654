"""The ops that take a live engine's device time (on a GPU: its kernels) at its largest decode batch.

``profile_decode`` fills an idle engine with ``batch`` requests, steps until every one is decoding, then runs
``steps`` decode-only steps under ``torch.profiler`` (CUDA activities on a GPU, CPU ones on a CPU) and
returns the ``top`` ops by self time on that device, with their share of all of it. The requests are
aborted afterwards: their blocks come back, the engine is idle again.

CUDA graphs: the profiler (CUPTI) records the kernels a graph replay runs, but a graph captured before the
process first used the profiler and replayed under it is a known failure (pytorch/pytorch#75504: an
illegal memory access; #100441: the workaround, ``torch.profiler._utils._init_for_cuda_graphs()``, an empty
profile before any capture). So no graph meets the profiler here: the profiled steps run eagerly (``mode``
"eager"), the runner's graphs set aside for them (``bench/engine_throughput.py`` goes further and profiles a
fresh engine whose graphs are set aside before any is captured). The kernels and their shapes are those a
replay runs (batch 256 is a captured size: no padding rows), so their device times are the replay's; only
the gaps between launches differ, and those are what ``bench/step_phases.py`` measures in the timed run.
On a CPU there are no graphs (``mode`` "cpu") and the ops are aten's, by CPU self time.
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from engine import SamplingParams
from engine.core import EngineCore


def profile_decode(core: EngineCore, prompts: list[list[int]], steps: int, top: int = 15) -> dict:
    """Profile ``steps`` decode-only steps of a batch of ``len(prompts)`` sequences on an idle ``core``.

    Returns ``kernel_profile_mode``, ``kernel_profile_batch`` (the decode batch profiled),
    ``kernel_profile_steps``, ``kernel_profile_step_ms`` (wall time per profiled step: eager, and slowed by
    the profiler), ``kernel_ms_per_step`` (all ops' self time on the device, per step) and
    ``kernels``: ``[{"name", "calls", "total_ms", "share"}]``, the ``top`` ops by self time, largest first."""
    if core.scheduler.has_work:
        raise RuntimeError("kernel profile: the engine must be idle (its timed run finished)")
    cuda = core.device.type == "cuda"
    requests = [core.make_request(p, SamplingParams(max_tokens=core.max_model_len - len(p), temperature=0.0,
                                                    ignore_eos=True)) for p in prompts]
    for request in requests:
        core.add(request)
    runner, graphs = core.runner, core.runner.graphs
    try:
        scheduler = core.scheduler
        while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
            core.step()  # prefill every prompt
        runner.graphs = None  # eager: see the module's docstring
        core.step()  # one eager step with every sequence decoding: anything it compiles, outside the profile
        batch = len(scheduler.running)
        sync(core.device)
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                core.step()
            sync(core.device)
            wall_s = time.perf_counter() - started
        if len(scheduler.running) != batch:
            raise RuntimeError(f"kernel profile: the decode batch went from {batch} to {len(scheduler.running)}")
    finally:
        runner.graphs = graphs
        for request in requests:
            core.abort(request.request_id)
    return {"kernel_profile_mode": "eager" if cuda else "cpu", "kernel_profile_batch": batch,
            "kernel_profile_steps": steps, "kernel_profile_step_ms": wall_s / steps * 1e3,
            **top_ops(prof, DeviceType.CUDA if cuda else DeviceType.CPU, steps, top)}


def top_ops(prof: profile, device: DeviceType, steps: int, top: int) -> dict:
    """The ``top`` ops of ``device`` by self time (on CUDA: kernels, copies and fills; on a CPU: aten ops)."""
    events = [e for e in prof.key_averages() if e.device_type == device]
    self_us = (lambda e: e.self_device_time_total) if device != DeviceType.CPU else (lambda e: e.self_cpu_time_total)
    total_us = sum(self_us(e) for e in events)
    ranked = sorted(events, key=self_us, reverse=True)[:top]
    return {"kernel_ms_per_step": total_us / 1e3 / steps,
            "kernels": [{"name": e.key, "calls": e.count, "total_ms": self_us(e) / 1e3,
                         "share": self_us(e) / total_us if total_us else None} for e in ranked]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_kernels(label: str, profiled: dict, width: int = 100) -> list[str]:
    """The printed form of ``profile_decode``'s result: a title line, then one line per op (name cut at
    ``width`` characters; the report keeps it whole)."""
    device = "device" if profiled["kernel_profile_mode"] != "cpu" else "CPU"
    title = (f"{label}: top {len(profiled['kernels'])} ops by {device} self time, {profiled['kernel_profile_steps']} "
             f"decode steps at batch {profiled['kernel_profile_batch']}, {profiled['kernel_profile_mode']}; "
             f"{profiled['kernel_ms_per_step']:.3f} ms of {device} time per step (step wall time under the "
             f"profiler {profiled['kernel_profile_step_ms']:.3f} ms)")
    lines = [title, f"{'share':>8}{'total ms':>11}{'calls':>7}  name"]
    for kernel in profiled["kernels"]:
        share = "n/a" if kernel["share"] is None else f"{kernel['share']:.1%}"
        lines.append(f"{share:>8}{kernel['total_ms']:>11.3f}{kernel['calls']:>7}  {kernel['name'][:width]}")
    return lines
