"""One `blink-appliance up` serving two models from one profile (issue 21), end to end: two ring
regions, two reference engine processes, the one front end routing by "model", driven by the
official `openai` client. SmolLM2-135M-Instruct under two names; the second has a shorter context,
so a prompt only it refuses shows which model's limits a request met."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import psutil
import pytest

from blink_appliance.profile import load_profile, region_name
from tests.live_appliance import API_KEY, LiveAppliance, start_profile

NAMES = ("smollm2-long", "smollm2-short")
SHORT_CONTEXT = 128


def write_two_model_profile(directory: Path, source: str) -> Path:
    models = "".join(
        f"""
[[models]]
name = "{name}"
source = "{source}"
dtype = "float32"
max_seqs = 8
max_model_len = {context}
max_num_batched_tokens = 256
kv_budget_gib = 0.05
"""
        for name, context in zip(NAMES, (512, SHORT_CONTEXT), strict=True)
    )
    path = directory / "profile.toml"
    path.write_text(
        f"""
[appliance]
shm_name = "blink-test-{os.getpid()}-{directory.name[-12:]}"
drain_timeout_s = 20
engine_restarts = 1
{models}
[frontend]
host = "127.0.0.1"
port = 0
max_inflight = 16
api_keys = ["{API_KEY}"]
"""
    )
    return path


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, smollm2_source: str):
    directory = tmp_path_factory.mktemp("two-models")
    profile = write_two_model_profile(directory, smollm2_source)
    app = start_profile(directory, profile)
    yield app
    code = app.stop()
    assert code == 0, f"appliance exited with {code}:\n{app.log()}"


@pytest.fixture(scope="module")
def client(two_models: LiveAppliance) -> openai.OpenAI:
    return openai.OpenAI(base_url=two_models.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_each_model_has_its_region_and_engine_and_the_ready_line_names_both(two_models):
    profile = load_profile(two_models.log_path.parent / "profile.toml")
    for i in range(2):
        assert Path("/dev/shm", region_name(profile, i)).exists()
    children = psutil.Process(two_models.proc.pid).children()
    engines = [c.cmdline() for c in children if "blink_appliance.engine.process" in " ".join(c.cmdline())]
    assert sorted(cmd[cmd.index("--model") + 1] for cmd in engines) == ["0", "1"]
    assert f"(models {NAMES[0]}, {NAMES[1]};" in two_models.log()


def test_the_models_list_names_both(client):
    assert sorted(m.id for m in client.models.list()) == sorted(NAMES)


@pytest.mark.parametrize("model", NAMES)
def test_a_completion_and_a_streamed_chat_for_each_model(client, model):
    comp = client.completions.create(model=model, prompt="Hello, my name is", temperature=0, max_tokens=4)
    assert comp.model == model
    assert comp.choices[0].text and 1 <= comp.usage.completion_tokens <= 4
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 2+2?"}],
        temperature=0,
        max_tokens=8,
        stream=True,
    )
    chunks = list(stream)
    assert chunks and all(c.model == model for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["length"],
        ["stop"],
    )


def test_each_request_meets_the_limits_of_the_model_it_names(client):
    """A prompt longer than the short model's context: refused for it, served by the long one."""
    prompt = "one two three four five six seven eight nine ten " * 20  # ~200 tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=NAMES[1], prompt=prompt, max_tokens=2)
    assert refused.value.code == "context_length_exceeded"
    served = client.completions.create(model=NAMES[0], prompt=prompt, temperature=0, max_tokens=2)
    assert served.usage.prompt_tokens > SHORT_CONTEXT


def test_an_unknown_model_gets_openais_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
