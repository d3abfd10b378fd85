"""A model with `replicas = 2` (issue 27): one `blink-appliance up`, two engine processes and ring
regions under one model name, the front end sending each request to the replica with the fewest
outstanding tokens; driven by the `openai` client."""

from __future__ import annotations

import asyncio

import openai
import pytest

from blink_appliance.profile import load_profile, region_name, ring_geometry
from blink_appliance.wire.region import RingRegion
from blink_appliance.wire.shm_transport import ShmTransport
from tests.live_appliance import API_KEY, MODEL_NAME, LiveAppliance, start_profile, write_profile

OUTPUT_TOKENS = 24


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("replicas")
    path = write_profile(directory, "dummy:tiny")
    path.write_text(path.read_text().replace('dtype = "float32"\n', 'dtype = "float32"\nreplicas = 2\n', 1))
    app = start_profile(directory, path)
    yield app
    code = app.stop()
    assert code == 0, f"appliance exited with {code}:\n{app.log()}"


def finished_by_each_engine(app: LiveAppliance) -> list[int]:
    profile = load_profile(app.log_path.parent / "profile.toml")
    out = []
    for i in range(len(profile.models)):
        transport = ShmTransport.open(region_name(profile, i))
        try:
            out.append(
                RingRegion.attach(transport, ring_geometry(profile, i)).read_telemetry()["requests_finished"]
            )
        finally:
            transport.close()
    return out


async def served_since(
    app: LiveAppliance, before: list[int], total: int, timeout_s: float = 30.0
) -> list[int]:
    """Requests each engine finished since `before`, once they add up to `total` (or at the deadline).
    An engine counts a request after publishing its last token, so the count can trail the response."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        served = [b - a for a, b in zip(before, finished_by_each_engine(app), strict=True)]
        if sum(served) >= total or asyncio.get_running_loop().time() > deadline:
            return served
        await asyncio.sleep(0.02)


async def test_two_replicas_serve_one_model_name_and_share_the_requests(replicated: LiveAppliance):
    assert "(model smollm2-135m-instruct x2;" in replicated.log()
    assert "engine of smollm2-135m-instruct (replica 2/2) is serving" in replicated.log()
    client = openai.AsyncOpenAI(base_url=replicated.url + "/v1", api_key=API_KEY, max_retries=0)

    async def one(k: int) -> tuple[str | None, int]:
        out = await client.completions.create(
            model=MODEL_NAME, prompt=[5 + k, 6], max_tokens=OUTPUT_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].finish_reason, out.usage.completion_tokens

    before = finished_by_each_engine(replicated)
    results = await asyncio.gather(*(one(k) for k in range(16)))
    await client.close()
    assert results == [("length", OUTPUT_TOKENS)] * 16
    served = await served_since(replicated, before, 16)
    assert sum(served) == 16 and min(served) >= 4, served  # both engines took a share
    assert [m.id for m in openai.OpenAI(base_url=replicated.url + "/v1", api_key=API_KEY).models.list()] == [
        MODEL_NAME
    ]
