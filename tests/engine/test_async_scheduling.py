"""Run-ahead scheduling (``async_scheduling``) changes when a step's tokens are read back, never which tokens
come out: the same prompts give the same completions with it and without it, every block comes back, and no
``PENDING`` placeholder ever reaches an output."""

from __future__ import annotations

import random

import openai
import pytest
import torch
from support.engine_server import ServerThread
from support.invariants import assert_all_blocks_back

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from engine.worker.runner import ModelRunner

OPTIONS = {"model": "tiny", "device": "cpu", "block_size": 4, "max_num_seqs": 16, "max_num_batched_tokens": 64}


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy, seeded sampling, forks, stop strings and EOS, with lengths that end sequences in most steps."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(20)]
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        params.append(SamplingParams(
            max_tokens=rng.randint(1, 30), temperature=0.0 if kind != 1 else 1.0, seed=i if kind == 1 else None,
            n=2 if kind == 2 else 1, stop=["+", "k", "/"] if kind == 3 else None,
            stop_token_ids=[64, 50] if kind == 0 else [], ignore_eos=kind == 0))
    return prompts, params


def count_run_ahead(runner: ModelRunner) -> list[int]:
    """From now on, count in the returned cell the steps that take a token the step before left unread."""
    execute, ran_ahead = runner.execute, [0]

    def counting(out, grammar=None, previous=None):
        ran_ahead[0] += previous is not None
        return execute(out, grammar, previous)

    runner.execute = counting  # type: ignore[method-assign]
    return ran_ahead


def generate(async_scheduling: bool, **options: object) -> tuple[list[RequestOutput], int]:
    """The outputs, and how many steps took a token that the step before had left on the device."""
    llm = LLM(**{**OPTIONS, **options}, async_scheduling=async_scheduling)
    ran_ahead = count_run_ahead(llm.core.runner)
    prompts, params = workload()
    outputs = llm.generate(prompts, params)
    assert_all_blocks_back(llm.core)
    return outputs, ran_ahead[0]


def completions(outputs: list[RequestOutput]) -> list[list[tuple]]:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("num_blocks", [512, 40], ids=["roomy", "preempting"])
def test_run_ahead_gives_the_same_completions(num_blocks: int) -> None:
    sync, ahead_sync = generate(False, num_blocks=num_blocks)
    ahead, ran_ahead = generate(True, num_blocks=num_blocks)
    assert ahead_sync == 0
    assert ran_ahead > 10, "steady decode steps ran ahead"
    assert completions(ahead) == completions(sync)
    assert all(t >= 0 for o in ahead for c in o.outputs for t in c.token_ids)
    reasons = {c.finish_reason for o in sync for c in o.outputs}
    assert reasons == {"stop", "length"}, reasons


def test_the_server_runs_ahead_and_streams_the_same_text() -> None:
    """Through the HTTP server (``--async-scheduling``): whole and streamed completions equal the offline
    engine's without run-ahead, and a stream the client drops mid-way gives every block back."""
    prompt, params = "Run ahead, then settle", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (expected,) = LLM(**OPTIONS).generate([prompt], params)
    greedy = {"max_tokens": 40, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    with ServerThread(num_blocks=256, block_size=16, async_scheduling=True) as server:
        ran_ahead = count_run_ahead(server.core.runner)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        whole = client.completions.create(model="tiny", prompt=prompt, **greedy)
        assert whole.choices[0].text == expected.text and whole.usage.completion_tokens == 40
        chunks = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, stream=True,
                                                                       **greedy) if c.choices]
        assert len(chunks) > 10 and "".join(chunks) == expected.text
        with client.completions.create(model="tiny", prompt=prompt, stream=True, **greedy) as stream:
            for index, _ in enumerate(stream):
                if index == 3:
                    break  # the client goes away: the server aborts the request
        server.wait_idle()
        assert_all_blocks_back(server.core)
    assert ran_ahead[0] > 30, "decode steps ran ahead"


def test_the_default_runs_ahead_on_cuda_only() -> None:
    """Unset, run-ahead is on where the device runs asynchronously (CUDA) and off on a CPU; set, as set. The
    engine's flag leaves it unset unless given either way."""
    from engine.__main__ import build_parser
    from engine.config import EngineConfig

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [EngineConfig(model="tiny").run_ahead(d) for d in (cpu, cuda)] == [False, True]
    assert [EngineConfig(model="tiny", async_scheduling=True).run_ahead(d) for d in (cpu, cuda)] == [True, True]
    assert [EngineConfig(model="tiny", async_scheduling=False).run_ahead(d) for d in (cpu, cuda)] == [False, False]
    parse = build_parser().parse_args
    assert [parse(flags).async_scheduling for flags in ([], ["--async-scheduling"], ["--no-async-scheduling"])
            ] == [None, True, False]
    assert not LLM(**OPTIONS).core.run_ahead
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="tiny", async_scheduling="yes")  # type: ignore[arg-type]
