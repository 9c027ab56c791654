"""The spread of the engine's CPU numerics across native builds and torch's CPU kernels, for the table in
docs/benchmarks/cpu-numerics.md.

For every native build this CPU runs (KVGUARD_NATIVE_TARGET: generic, avx2, avx512) and the native path off
(KVGUARD_NATIVE=0), crossed with every ATen CPU capability it runs (ATEN_CPU_CAPABILITY=default, avx2,
avx512), one fresh process measures (the plain C build compiled for -march=x86-64-v3/v4 is compared bit for
bit by tests/engine/test_native_kernels.py, which runs here too):

- ``native_digest``: a hash of the native kernels' outputs on fixed inputs (int4 product, RMSNorm, a decode
  step of the random int4 model of tests/support/native_model.py): equal everywhere means CPU-independent;
- ``flip_ratio``: the largest layer difference native vs torch over 5 seeds x 3 batches, as a share of the
  layer's flip bound (tests/engine/test_native_decode.py): the test fails above 1;
- ``torch_digest``: a hash of the torch path's layer outputs (which the capability may move).

Then, unless ``--no-tests``, the native tests run under each configuration (pass/fail counts).

    .venv/bin/python bench/cpu_numerics.py --json bench/results/cpu_numerics.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from run_info import command, cpu_name, print_preamble, write_report

ROOT = Path(__file__).resolve().parents[1]
CAPABILITIES = ("default", "avx2", "avx512")
NATIVE_TESTS = ["tests/engine/test_native_decode.py", "tests/engine/test_native_kernels.py",
                "tests/engine/test_weight_formats.py", "tests/engine/test_attention_ref.py"]


def measure() -> dict:
    """One configuration, in this process (the environment chose the build and the capability)."""
    sys.path.insert(0, str(ROOT / "tests"))  # the test suite's model and bound, not a second copy of them
    import numpy as np
    import torch
    from support.native_model import decode_inputs, normal, random_int4_model, torch_layer

    from engine.kernels.native import library, q4
    from engine.model.native_decode import NativeDecoder
    from engine.model.weights import quantize_q4

    kernels = library.library()
    result = {"native": library.status().path, "capability": torch.backends.cpu.get_cpu_capability()}
    if kernels is None:
        return {**result, "reason": library.status().reason}
    model = random_int4_model()
    stack, native_hash, torch_hash, ratio = model.model, hashlib.sha256(), hashlib.sha256(), 0.0
    rng = np.random.default_rng(0)
    qpack, scales = q4.pack(*quantize_q4(normal(rng, (96, 256)) * 0.05))
    x = normal(rng, (5, 256))
    native_hash.update(kernels.q4_matmul(x, qpack, scales).numpy().tobytes())
    native_hash.update(kernels.rms_norm(x, normal(rng, (256,)), 1e-6).numpy().tobytes())
    with torch.inference_mode():
        for seed in range(1, 6):
            for seq_lens in ([1], [37], [5, 16, 40]):
                hidden, positions, caches, meta = decode_inputs(model, seq_lens, seed)
                native_hash.update(NativeDecoder(stack, kernels).run(hidden.clone(), positions,
                                                                     [c.clone() for c in caches], meta).numpy().tobytes())
                for i, layer in enumerate(stack.layers):
                    expected, bound = torch_layer(layer, hidden.clone(), positions, stack.rotary_emb,
                                                  caches[i].clone(), meta)
                    one = NativeDecoder(type("Stack", (), {"layers": [layer], "rotary_emb": stack.rotary_emb}),
                                        kernels)
                    got = one.run(hidden.clone(), positions, [caches[i].clone()], meta)
                    ratio = max(ratio, ((got - expected).abs().max() / bound).item())
                    torch_hash.update(expected.numpy().tobytes())
                    hidden = expected
    return {**result, "native_digest": native_hash.hexdigest()[:16], "torch_digest": torch_hash.hexdigest()[:16],
            "flip_ratio": round(ratio, 4)}


def configurations() -> list[dict[str, str]]:
    sys.path.insert(0, str(ROOT))
    import torch

    from engine.kernels.native import library

    builds = [{"KVGUARD_NATIVE_TARGET": t} for t in ("generic", "avx2", "avx512") if library.runs(t)]
    builds.append({"KVGUARD_NATIVE": "0"})  # torch's kernels alone: the native tests must hold there too
    best = torch.backends.cpu.get_cpu_capability().lower()
    capabilities = CAPABILITIES[: CAPABILITIES.index(best) + 1] if best in CAPABILITIES else ("default",)
    return [{**build, "ATEN_CPU_CAPABILITY": c} for build in builds for c in capabilities]


def run(env: dict[str, str], tests: bool) -> dict:
    full_env = {**os.environ, **env}
    done = subprocess.run([sys.executable, __file__, "--measure"], env=full_env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=True)
    row = {**env, **json.loads(done.stdout.strip().splitlines()[-1])}
    if tests:
        pytest = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *NATIVE_TESTS],
                                env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
        row["tests"] = pytest.stdout.strip().splitlines()[-1] if pytest.stdout.strip() else f"rc {pytest.returncode}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-tests", action="store_true", help="measure only; do not run the native tests")
    parser.add_argument("--json", type=Path, help="write the raw report here")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    import torch

    print_preamble(torch.device("cpu"), smoke=False)
    rows = [run(env, not args.no_tests) for env in configurations()]
    for row in rows:
        print(json.dumps(row))
    digests = {row.get("native_digest") for row in rows if "native_digest" in row}
    print(f"native outputs identical across {len(rows)} configurations: {len(digests) == 1}")
    if args.json:
        write_report(args.json, {"machine": cpu_name(), "command": command(), "rows": rows,
                                 "native_identical": len(digests) == 1})


if __name__ == "__main__":
    main()
