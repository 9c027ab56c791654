"""Bad input is a ValueError that names the field, and leaves the engine exactly as it was."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


def state(llm: LLM) -> tuple:
    snap = llm.telemetry()
    return (snap.free_blocks, snap.num_waiting, snap.num_running, len(llm.core.requests), snap.step)


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompts"),
        ([[]], SamplingParams(), "prompt"),
        ("x" * 5000, SamplingParams(), "prompt"),
        ([5, 99999], SamplingParams(), "prompt"),
        (["fine", ""], SamplingParams(), "prompt"),  # the good first prompt must not be queued either
        ("hello", SamplingParams(max_tokens=4000), "max_tokens"),
        ("hello", SamplingParams(n=100), "n"),
        ("hello", "not params", "sampling_params"),
        (["a", "b"], [SamplingParams()], "sampling_params"),
    ],
)
def test_bad_requests_name_the_field_and_change_nothing(llm: LLM, prompts, params, field: str) -> None:
    before = state(llm)
    with pytest.raises(ValueError, match=rf"^{field}: "):
        llm.generate(prompts, params)
    assert state(llm) == before


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "12"}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: must be"):
        SamplingParams(**kwargs)


def test_unknown_model_path_names_the_field(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"^model: ") as info:
        LLM(str(tmp_path / "no-such-model"), device="cpu")
    assert "no-such-model" in str(info.value)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"block_size": 12}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"attention_backend": "cudnn"}, "attention_backend"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 100000}, "max_model_len"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_engine_options(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        LLM("tiny", device="cpu", **options)


def test_prompt_is_checked_against_a_configured_context_window() -> None:
    llm = LLM("tiny", device="cpu", num_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match=r"^prompt: .*32 tokens"):
        llm.generate("y" * 32)
    out = llm.generate("y" * 20, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
