"""The capacity planner (issue 18): ``python -m guard.plan --workload plan.yaml [--json] [--from-engine URL]``.

One concern per module:

    workload.py     the workload file: pydantic models, unknown keys and bad numbers refused by name
    model_shape.py  the model's KV shape and weights: given, or read from smollm2, a HF directory or a GGUF file
    engine_pool.py  a live engine's KV pool (--from-engine), from its /telemetry and /metrics
    sizing.py       pool, per-sequence demand, demand at peak, safe envelope, verdict, GPUs and stream slots
    queueing.py     Erlang-C over stream slots: P(wait), mean wait, replicas for a wait target
    planner.py      ``make_plan``: the above, in order
    report.py       the plan as JSON and as text
    __main__.py     the command line
"""
