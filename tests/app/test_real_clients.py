"""Real third-party clients against one live server on loopback: what users actually point at us.

- lm-eval-harness's `local-completions` model through `lm_eval.simple_evaluate` on two tiny local
  tasks (a JSONL file in tmp_path): multiple_choice (prompt scoring: token-id prompts with
  `echo: true, logprobs: 1, max_tokens: 1`) and generate_until.
- LangChain's `ChatOpenAI`: `bind_tools(..., tool_choice=<name>)` and `with_structured_output`.
- The official `openai` SDK: `chat.completions.parse` with `pydantic_function_tool` (strict
  tools), `completions.create(echo=True, logprobs=1, max_tokens=0)` on token ids, and a stream
  with `continuous_usage_stats`.
- guidellm: a few seconds of streaming /v1/completions at concurrency 2 on synthetic data.

The server runs the tiny random target of tests.fixtures.models (fp32, CPU) with a chat template
that renders tools; prompt scores are checked against a plain HF transformers forward of the same
directory. Nothing here may reach a model hub: tokenizers are local paths, datasets local files,
and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set for this process and the subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.fixtures.servers import ServerProcess
from tests.fixtures.tool_models import save_tiny_tool_target

pytestmark = pytest.mark.slow

MODEL = "tiny-tools"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ATOL = 1e-3  # fp32 on both sides; the server's batched forward need not be bit-identical to HF's
# Scored by lm-eval: each context gets its greedy continuation (when it re-tokenizes to the same
# ids) among the choices, so both is_greedy outcomes are exercised.
CONTEXTS = ["The quick brown fox", "def add(a, b):", "Hello world, hello", "Speculative decoding drafts"]
OTHER_CHOICES = [" jumps over", " café résumé", "\n    return a"]
GEN_UNTIL = ["\n\n"]
GEN_TOKENS = 8


# Bounded parameters (closed objects, enums, short strings): whatever a random target samples under
# constrained decoding, the call or answer ends well within max_tokens.
class GetWeather(BaseModel):
    """Current weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """Local time in a time zone."""

    model_config = ConfigDict(extra="forbid")
    tz: Literal["CET", "UTC"]


class Fox(BaseModel):
    """A fox, described."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=8)
    legs: int = Field(ge=0, le=9)
    wild: bool


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    """Hub access off for this module: the environment (subprocesses, later imports) and the flags
    huggingface_hub / datasets already read at import time."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def tool_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_tool_target(tmp_path_factory.mktemp("tiny-tools"))


@pytest.fixture(scope="module")
def srv(server_factory: Callable[..., ServerProcess], tool_target: tuple[Path, Path]) -> Iterator[ServerProcess]:
    target, drafter = tool_target
    # 2048: the tools block alone is ~600 tokens of the tiny byte-level vocabulary.
    server = server_factory(
        target=target, drafter=drafter, served_model_name=MODEL, max_batch_size=4, max_model_len=2048
    )
    yield server
    server.stop()  # free the CPU for later modules (the factory's own stop is then a no-op)


@pytest.fixture(scope="module")
def hf(tool_target: tuple[Path, Path]) -> tuple[Any, Any]:
    """The served target loaded by HF transformers in fp32: the reference for prompt scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tool_target[0], dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(tool_target[0])


@pytest.fixture(scope="module")
def sdk(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def token_scores(hf: tuple[Any, Any], ids: list[int], start: int) -> list[tuple[float, bool]]:
    """(log p, is argmax) of ids[i] given ids[:i] for i >= start, from one HF forward."""
    import torch

    model, _ = hf
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [(float(logp[i - 1, ids[i]]), int(logp[i - 1].argmax()) == ids[i]) for i in range(start, len(ids))]


def reference_loglikelihood(hf: tuple[Any, Any], context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval should get for (context, continuation): it encodes context + continuation whole
    and scores the tokens past the context's own encoding."""
    _, tok = hf
    ctx = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    scores = token_scores(hf, whole, len(ctx))
    return sum(s for s, _ in scores), all(g for _, g in scores)


def greedy_continuation(hf: tuple[Any, Any], context: str, n: int = 3) -> str | None:
    """The target's greedy n tokens after context as text, if that text re-tokenizes to them."""
    import torch

    model, tok = hf
    ids = tok(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()
    text = tok.decode(out)
    same = tok(context + text, add_special_tokens=False).input_ids == ids + out
    return text if same and "\ufffd" not in text and len(out) == n else None


# -- lm-eval-harness ------------------------------------------------------------------------------


def write_tasks(root: Path, docs: list[dict[str, Any]]) -> None:
    """Two lm-eval tasks over one local JSONL file (dataset_path json: no hub)."""
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    dataset = {"data_files": {"test": str(data)}, "cache_dir": str(root / "hf-datasets")}
    common = {"dataset_path": "json", "dataset_kwargs": dataset, "test_split": "test", "doc_to_text": "{{context}}"}
    mc = {
        **common,
        "task": "tiny_mc",
        "output_type": "multiple_choice",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": "",  # the choices carry their own leading space (or none)
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    gen = {
        **common,
        "task": "tiny_gen",
        "output_type": "generate_until",
        "doc_to_target": "{{choices[0]}}",
        "generation_kwargs": {"until": GEN_UNTIL, "max_gen_toks": GEN_TOKENS, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    # JSON is YAML: lm-eval's loader reads these as they are.
    (root / "tiny_mc.yaml").write_text(json.dumps(mc))
    (root / "tiny_gen.yaml").write_text(json.dumps(gen))


@pytest.fixture(scope="module")
def lm_eval_tasks(hf: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The task directory and its documents."""
    docs = []
    for context in CONTEXTS:
        greedy = greedy_continuation(hf, context)
        docs.append({"context": context, "choices": ([greedy] if greedy else []) + OTHER_CHOICES, "answer": 0})
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    write_tasks(root, docs)
    return root, docs


def run_lm_eval(
    srv: ServerProcess, tool_target: tuple[Path, Path], tasks: Path, task: str, backend: str = "huggingface"
) -> dict[str, Any]:
    """simple_evaluate of one task through lm-eval's local-completions model; with the remote backend
    lm-eval tokenizes through the server (/tokenizer_info, /tokenize, /detokenize)."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(
        base_url=srv.url + "/v1/completions",
        model=MODEL,
        tokenizer_backend=backend,
        # A local path: lm-eval tokenizes, the server gets token ids.
        tokenizer=str(tool_target[0]) if backend == "huggingface" else None,
        batch_size=2,  # several token-id prompts in one request
        max_length=2048,
        max_retries=1,  # a refused request fails the test at once, not after backoff
        timeout=60,
    )
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        num_fewshot=0,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    return out


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_loglikelihoods_match_hf(
    srv: ServerProcess,
    tool_target: tuple[Path, Path],
    lm_eval_tasks: tuple[Path, list[dict[str, Any]]],
    hf: tuple[Any, Any],
    backend: str,
) -> None:
    """Each (context, choice) score lm-eval computed from the server's echoed prompt logprobs is the
    HF forward's, and so is its is_greedy flag (read from the top-1 prompt logprobs)."""
    tasks, docs = lm_eval_tasks
    out = run_lm_eval(srv, tool_target, tasks, "tiny_mc", backend)
    samples = out["samples"]["tiny_mc"]
    assert len(samples) == len(docs)
    want_greedy, correct = [], []
    for sample in samples:
        got = [resp[0] for resp in sample["resps"]]
        want = [reference_loglikelihood(hf, ctx, cont) for ctx, cont in sample["arguments"]]
        assert len(got) == len(want) == len(sample["doc"]["choices"])
        for (got_ll, got_greedy), (want_ll, greedy) in zip(got, want, strict=True):
            assert got_ll == pytest.approx(want_ll, abs=ATOL), (sample["arguments"], got, want)
            assert got_greedy == greedy, (sample["arguments"], got, want)
        want_greedy += [g for _, g in want]
        correct.append(max(range(len(want)), key=lambda i: want[i][0]) == sample["doc"]["answer"])
    assert any(want_greedy) and not all(want_greedy)  # both outcomes were exercised
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_lm_eval_generate_until_matches_server_greedy(
    srv: ServerProcess,
    tool_target: tuple[Path, Path],
    lm_eval_tasks: tuple[Path, list[dict[str, Any]]],
    hf: tuple[Any, Any],
) -> None:
    """generate_until (token-id prompts, temperature 0, stop = until + the EOS string) writes what
    the server's own greedy /v1/completions writes for the same text prompt."""
    tasks, docs = lm_eval_tasks
    out = run_lm_eval(srv, tool_target, tasks, "tiny_gen")
    samples = out["samples"]["tiny_gen"]
    assert len(samples) == len(docs)
    eos = hf[1].eos_token
    for sample in samples:
        context = sample["arguments"][0][0]
        body = {"model": MODEL, "prompt": context, "max_tokens": GEN_TOKENS, "temperature": 0}
        body["stop"] = [*GEN_UNTIL, eos]
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert sample["resps"][0][0] == r.json()["choices"][0]["text"], context


# -- LangChain ------------------------------------------------------------------------------------


def chat_model(srv: ServerProcess, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 120, **kwargs}
    return ChatOpenAI(model=MODEL, base_url=srv.url + "/v1", api_key="unused", max_retries=0, **settings)


def assert_one_weather_call(message: Any) -> None:
    assert len(message.tool_calls) == 1 and not message.invalid_tool_calls, message
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"], call
    GetWeather.model_validate(call["args"])


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_langchain_bind_tools_forced_choice(srv: ServerProcess, stream: bool) -> None:
    """A named tool_choice (LangChain sends no parallel_tool_calls) gives exactly one call of that
    tool, whose arguments validate against its schema."""
    llm = chat_model(srv).bind_tools([GetWeather, GetTime], tool_choice="GetWeather")
    if stream:
        message: Any = None
        for chunk in llm.stream(ASK):
            message = chunk if message is None else message + chunk
    else:
        message = llm.invoke(ASK)
    assert_one_weather_call(message)


def test_langchain_bind_tools_forced_choice_sampled(srv: ServerProcess) -> None:
    """Sampled, the random target would go on to further calls after the first: a named
    tool_choice still ends after exactly one."""
    for seed in range(12):  # before the fix, seed 11 went on to a second call
        llm = chat_model(srv, temperature=1.0, seed=seed).bind_tools([GetWeather, GetTime], tool_choice="GetWeather")
        message = llm.invoke(ASK)
        assert message.response_metadata["finish_reason"] == "tool_calls", (seed, message)
        assert_one_weather_call(message)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(srv: ServerProcess, method: str) -> None:
    """with_structured_output returns a valid instance, through response_format (json_schema) or a
    forced tool call (function_calling)."""
    fox = chat_model(srv).with_structured_output(Fox, method=method).invoke("Describe a fox.")
    assert isinstance(fox, Fox), fox


# -- the openai SDK -------------------------------------------------------------------------------


def test_openai_parse_with_strict_pydantic_tools(sdk: openai.OpenAI) -> None:
    """pydantic_function_tool sets `strict: true`: accepted, and the calls parse into the model."""
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    assert all(t["function"]["strict"] is True for t in tools)
    forced = sdk.chat.completions.parse(
        model=MODEL, messages=ASK, tools=tools, tool_choice="required", max_tokens=120, temperature=0
    )
    calls = forced.choices[0].message.tool_calls or []
    assert len(calls) >= 1 and forced.choices[0].finish_reason == "tool_calls", forced
    for call in calls:
        assert isinstance(call.function.parsed_arguments, GetWeather | GetTime), call
    # Under auto the model may answer in text; a call it makes still follows its strict schema.
    free = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=60, temperature=0)
    models = {"GetWeather": GetWeather, "GetTime": GetTime}
    for call in free.choices[0].message.tool_calls or []:
        models[call.function.name].model_validate_json(call.function.arguments)


def test_openai_completions_echo_prompt_logprobs(sdk: openai.OpenAI, hf: tuple[Any, Any]) -> None:
    """echo + logprobs with max_tokens 0 scores a token-id prompt: one logprob per prompt token,
    the first None, the rest the HF forward's; top_logprobs likewise, the top-1 at least as likely."""
    _, tok = hf
    ids = tok("The quick brown fox jumps over the lazy dog.", add_special_tokens=False).input_ids
    r = sdk.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = token_scores(hf, ids, 1)
    assert lp.token_logprobs[1:] == pytest.approx([s for s, _ in want], abs=ATOL)
    for got, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top and len(top) == 1 and max(top.values()) >= got - ATOL, top


def test_openai_stream_continuous_usage_stats(sdk: openai.OpenAI) -> None:
    """stream_options.continuous_usage_stats (vLLM's; guidellm always sends it): every chunk
    carries usage, the completion count never falls, and the last usage is the whole."""
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        sdk.completions.create(
            model=MODEL, prompt="Hello world", max_tokens=12, temperature=0, stream=True, stream_options=options
        )
    )
    assert chunks and all(c.usage is not None for c in chunks), chunks
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)


# -- guidellm -------------------------------------------------------------------------------------


def test_guidellm_streaming_benchmark(srv: ServerProcess, tool_target: tuple[Path, Path], tmp_path: Path) -> None:
    """guidellm (streaming /v1/completions, stream_options with continuous_usage_stats, ignore_eos)
    for a few seconds at concurrency 2 on synthetic prompts: requests complete, none errs."""
    report = tmp_path / "benchmarks.json"
    scenario = {
        "spec": {
            "backend": {"kind": "openai_http", "target": srv.url, "model": MODEL, "request_format": "/v1/completions"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(tool_target[0])},  # local: no hub
            "profile": {"kind": "concurrent", "streams": [2]},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 16, "output_tokens": 8}],
            "constraints": [{"kind": "max_duration", "seconds": 6}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUIDELLM")}
    proc = subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "--scenario", str(path), "--disable-console"],
        cwd=tmp_path,
        env={**env, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (bench,) = json.loads(report.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    errors = [r["info"].get("error") for r in bench["requests"]["errored"][:3]]
    assert totals["errored"] == 0 and totals["successful"] > 0, (totals, errors)
    # Output counts came from the streamed usage: every completed request wrote its 8 tokens.
    assert {r["output_metrics"]["text_tokens"] for r in bench["requests"]["successful"]} == {8}
