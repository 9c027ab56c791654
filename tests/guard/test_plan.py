"""The capacity planner (guard/plan/): reference 000's worked example through the real command line and in
process, Erlang-C against the closed form worked by hand, model shapes read from smollm2, a GGUF file and a
Hugging Face directory, the pool of a real tiny engine (--from-engine), and bad input refused by name."""

from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from support import ROOT
from support.engine_server import ServerThread
from support.gguf_files import write_tiny_gguf
from support.net import free_port
from support.processes import run_command

from engine.model.gguf_config import config_from_gguf
from engine.model.gguf_file import GGUFMetadata, open_gguf
from engine.model.sources import smollm2_path
from engine.model.tiny import tiny_config
from guard.plan.__main__ import main
from guard.plan.model_shape import resolve_shape
from guard.plan.planner import make_plan
from guard.plan.queueing import erlang_c, mean_wait
from guard.plan.report import to_json, to_text
from guard.plan.workload import NamedModel, load_workload

EXAMPLE = ROOT / "plan.example.yaml"
CONTRACT = {"pool_gib": 61.47, "demand_gib": 46.16, "safe_gib": 43.03, "fits_one_gpu": False, "gpus_needed": 2}


def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def write(tmp_path: Path, workload: dict[str, Any]) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(workload))
    return path


def plan_json(path: Path, *flags: str) -> dict[str, Any]:
    return to_json(make_plan(load_workload(path), path.parent, *flags))


def test_the_worked_example_through_the_command_line() -> None:
    done = run_command(sys.executable, "-m", "guard.plan", "--workload", EXAMPLE, "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {key: report[key] for key in CONTRACT} == CONTRACT
    assert [c["aggregate_gib"] for c in report["classes"]] == [5.46, 20.62, 20.08]  # the reference's table


def test_the_worked_example_in_process() -> None:
    plan = make_plan(load_workload(EXAMPLE), ROOT)
    s = plan.sizing
    assert s.pool_bytes == 141_000_000_000 - 70_000_000_000 - 5_000_000_000
    # Step 2 of the reference, to the byte: 2 x 80 x 8 x 128 x context x 1.
    assert [c.sequence_bytes for c in s.classes] == [209_715_200, 2_768_240_640, 5_389_680_640]
    assert [c.streams for c in s.classes] == pytest.approx([28, 8, 4])
    assert round(s.demand_bytes / 2**30, 2) == 46.17  # exact; the contract's 46.16 sums the quoted figures
    assert {k: to_json(plan)[k] for k in CONTRACT} == CONTRACT
    assert s.fits_raw_pool and not s.fits_one_gpu
    text = to_text(plan)
    assert "61.47 GiB" in text and "46.16" in text and "43.03 GiB" in text and "2 GPUs" in text


def closed_form_erlang_c(c: int, a: int) -> Fraction:
    """P(wait) = (a^c / c!) / (1 - rho) over (sum_{k<c} a^k / k! + (a^c / c!) / (1 - rho)), in exact fractions."""
    rho = Fraction(a, c)
    top = Fraction(a**c, math.factorial(c)) / (1 - rho)
    return top / (sum(Fraction(a**k, math.factorial(k)) for k in range(c)) + top)


@pytest.mark.parametrize(("servers", "offered"), [(1, 0), (2, 1), (4, 1), (10, 7), (200, 180)])
def test_erlang_c_agrees_with_the_closed_form(servers: int, offered: int) -> None:
    assert erlang_c(servers, offered) == pytest.approx(float(closed_form_erlang_c(servers, offered)), rel=1e-9)
    assert erlang_c(servers, servers) == 1.0 and math.isinf(mean_wait(servers, servers, 1.0))


def test_a_second_case_worked_by_hand(tmp_path: Path) -> None:
    """Two stream slots per replica (a 1000-byte pool, 500-byte sequences), 1 request/s of 1 s each:
    a = 1 Erlang on 2 servers, P0 = 1 / (1 + 1 + 1/(2 x 0.5)) = 1/3, P(wait) = 1/3, mean wait 1/3 s; the 0.2 s
    target needs a second replica (4 servers: P(wait) = (1/18) / (8/3 + 1/18) = 1/49, mean wait 1/147 s)."""
    workload = {"model": {"layers": 1, "kv_heads": 1, "head_dim": 1, "kv_bytes": 1, "weight_bytes": 0},
                "gpu": {"memory_gb": 1e-6}, "margin": 0.0, "streams": 2,
                "mix": [{"name": "only", "share": 1.0, "p95_input": 100, "p95_output": 150}],
                "arrivals": {"rate_per_s": 1.0, "mean_service_s": 1.0, "max_wait_s": 0.2}}
    report = plan_json(write(tmp_path, workload))
    assert (report["pool_bytes"], report["slots_per_replica"], report["gpus_needed"]) == (1000, 2, 1)
    q = report["queueing"]
    assert q["offered_erlangs"] == 1.0 and (q["replicas_for_max_wait"], q["replicas_needed"]) == (2, 2)
    one, two = q["rows"]
    assert (one["servers"], one["utilization"]) == (2, 0.5)
    assert one["p_wait"] == pytest.approx(1 / 3) and one["mean_wait_s"] == pytest.approx(1 / 3)
    assert two["p_wait"] == pytest.approx(1 / 49) and two["mean_wait_s"] == pytest.approx(1 / 147)


def test_smollm2_shape_is_read_from_its_gguf(tmp_path: Path) -> None:
    shape = resolve_shape(NamedModel(name="smollm2"), tmp_path)
    assert Path(shape.source) == smollm2_path()  # found where the engine finds it
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.kv_bytes) == (30, 3, 64, 2)
    assert shape.bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert shape.weight_bytes == 134_515_008 * 2  # SmolLM2-135M's parameters, dequantized to BF16


def test_a_gguf_file_by_relative_path_agrees_with_the_engines_loader(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    path = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    reader = open_gguf(path)
    config = config_from_gguf(GGUFMetadata(path, reader.fields), {t.name: t for t in reader.tensors})
    shape = resolve_shape(NamedModel(name="models/tiny.gguf", kv_bytes=4), tmp_path)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (config.num_hidden_layers,
                                                              config.num_key_value_heads, config.head_dim)
    assert shape.weight_bytes == config.num_parameters() * 4
    assert shape.context_window == config.max_position_embeddings


def test_a_hugging_face_directory(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}))
    save_file({"a": np.zeros((4, 5), np.float16), "b": np.zeros(7, np.float16)}, str(tmp_path / "m.safetensors"))
    shape = resolve_shape(NamedModel(name=".", weight_bytes=None), tmp_path)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.weight_bytes) == (3, 2, 32, 27 * 2)
    assert shape.context_window is None, "no max_position_embeddings: not checked"


def test_a_class_longer_than_the_models_context_window_blocks_the_plan(tmp_path: Path) -> None:
    """However many GPUs, the engine refuses a request past the model's window: the plan names the class."""
    workload = example()
    workload["model"] = {**workload["model"], "context_window": 8192}  # the example's: 1,280, 16,896, 32,896
    report = plan_json(write(tmp_path, workload))
    assert report["gpus_needed"] is None and report["model"]["context_window"] == 8192
    blocker = report["blocker"]
    assert "8,192" in blocker and all(f"{name!r}" in blocker for name in ("rag", "agent")), blocker
    assert "'conversational'" not in blocker, "a class within the window is not named"
    workload["model"]["context_window"] = 65536
    assert plan_json(write(tmp_path, workload))["gpus_needed"] == CONTRACT["gpus_needed"], "within it: as before"


def test_the_pool_of_a_live_engine(tmp_path: Path) -> None:
    """A tiny engine of 29 blocks of 16 tokens; 96-token sequences take 6 blocks: at margin 0.15 (the guard's
    default safe_utilization, 0.85) the envelope holds 24.65 blocks, 4 such sequences, as the guard admits."""
    tiny = tiny_config()
    model = {"layers": tiny.num_hidden_layers, "kv_heads": tiny.num_key_value_heads, "head_dim": tiny.head_dim,
             "kv_bytes": 4, "weight_bytes": 0}
    workload = {"model": model, "margin": 0.15, "streams": 4,
                "mix": [{"name": "chat", "share": 1.0, "p95_input": 40, "p95_output": 50}],
                "arrivals": {"rate_per_s": 2.0, "mean_service_s": 1.0, "max_wait_s": 60.0}}
    path = write(tmp_path, workload)
    with ServerThread(num_blocks=29, block_size=16) as engine:
        report = plan_json(path, engine.url)
        done = run_command(sys.executable, "-m", "guard.plan", "--workload", path, "--json", "--from-engine",
                           engine.url, timeout=60)
        mismatched = plan_json(write(tmp_path, {**workload, "model": {**model, "kv_bytes": 2}}), engine.url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == report
    per_token = 2 * 4 * 2 * 16 * 4
    assert report["engine"] | {"url": None} == {"url": None, "model": "tiny", "num_blocks": 29, "block_size": 16,
                                                "dtype": "float32", "tokens": 29 * 16}
    assert report["pool_bytes"] == 29 * 16 * per_token and report["pool_source"] == "engine"
    assert report["classes"][0]["context_tokens"] == 96  # 90 tokens take 6 whole blocks
    assert (report["slots_per_replica"], report["gpus_needed"], report["fits_one_gpu"]) == (4, 1, True)
    assert report["queueing"]["rows"][0]["servers"] == 4
    assert any("engine caches float32" in w for w in mismatched["warnings"])


def bad(tmp_path: Path, capsys: pytest.CaptureFixture[str], workload: dict[str, Any] | str,
        *flags: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(workload if isinstance(workload, str) else yaml.safe_dump(workload))
    assert main(["--workload", str(path), *flags]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("change", "message"), [
    ({"stream": 40}, "stream: unknown key 'stream'"),
    ({"margin": -0.3}, "margin: Input should be greater than or equal to 0"),
    ({"streams": -1}, "streams: Input should be greater than 0"),
    ({"model": {"layers": 80, "kv_heads": 8, "head_dim": 128, "kv_bytes": 1, "weight_bytes": -1}},
     "weight_bytes: Input should be greater than or equal to 0"),
    ({"mix": [{"name": "a", "share": 0.5, "p95_input": 1, "p95_output": 1},
              {"name": "b", "share": 0.4, "p95_input": 1, "p95_output": 1}]}, "shares must sum to 1, they sum to 0.9"),
    ({"gpu": None}, "gpu: required"),
    ({"model": {"name": "no/such/model.gguf"}}, "model.name: 'no/such/model.gguf' is neither"),
])
def test_bad_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict[str, Any],
                            message: str) -> None:
    assert message in bad(tmp_path, capsys, {**example(), **change})


def test_bad_files_and_engines_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--workload", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: cannot read: No such file or directory" in capsys.readouterr().err
    assert "duplicate key 'streams'" in bad(tmp_path, capsys, EXAMPLE.read_text() + "streams: 41\n")
    url = f"http://127.0.0.1:{free_port()}"
    assert f"{url}/telemetry: cannot be read" in bad(tmp_path, capsys, example(), "--from-engine", url)


def test_a_workload_no_replica_can_hold_still_gets_a_plan(tmp_path: Path) -> None:
    too_heavy = plan_json(write(tmp_path, {**example(), "gpu": {"memory_gb": 60}}))
    assert too_heavy["gpus_needed"] is None and "no room for KV" in too_heavy["blocker"]
    assert too_heavy["warnings"] and "queueing" not in too_heavy
    too_long = {**example(), "mix": [{"name": "book", "share": 1.0, "p95_input": 400_000, "p95_output": 1}]}
    report = plan_json(write(tmp_path, too_long))
    assert report["gpus_needed"] is None and "'book' sequence" in report["blocker"]
