"""Schemathesis against a live server (uvicorn on loopback, the tiny Qwen3 target), driven by the
schema the server itself serves at /openapi.json: valid and invalid requests to every operation,
a bounded number per operation. No 5xx, every error in OpenAI's shape, the server healthy after.

The server's context is small (64 tokens) so generated requests finish quickly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.fixtures.servers import ServerProcess

EXAMPLES_PER_OPERATION = 30  # per operation and mode (valid / invalid requests)


@pytest.fixture(scope="module")
def fuzz_server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return server_factory(max_model_len=64, max_batch_size=2, max_waiting=16, max_n=4)


@pytest.fixture(scope="module")
def api_schema(fuzz_server: ServerProcess) -> Any:
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/tokenizer_info"),
    ("GET", "/version"),
]


def test_openapi_schema_is_served(fuzz_server: ServerProcess) -> None:
    spec = httpx.get(fuzz_server.url + "/openapi.json", timeout=10).json()
    assert {path for _, path in OPERATIONS} == set(spec["paths"])
    post = spec["paths"]["/v1/completions"]["post"]
    assert "422" not in post["responses"] and "400" in post["responses"]  # invalid input is a 400 here


def check_response(case: Any, response: Any) -> None:
    """No 5xx; any error (but /health's own 503 body) in OpenAI's shape."""
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400 and case.path != "/health":
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


# Invalid requests only where there is something to get wrong (a body): for operations without
# parameters schemathesis cannot generate any.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_no_5xx_and_openai_shaped_errors(api_schema: Any, method: str, path: str, mode: GenerationMode) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,  # nothing written into the repository
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        check_response(case, case.call(timeout=60))

    run()


def test_server_healthy_after_fuzzing(fuzz_server: ServerProcess) -> None:
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    # ignore_eos: the request samples (T = 1) from a random 800-token model, which draws EOS within
    # 4 tokens about once in 200 runs; the check is that the server still generates, not where it stops.
    body = {"prompt": [5, 6], "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(fuzz_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["finish_reason"] == "length"
