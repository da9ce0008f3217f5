"""Service configuration: DOMINO_* environment variables, mirrored by the domino-serve flags."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.kv.sizes import parse_memory

Mode = Literal["domino", "dflash", "ngram", "ar"]
Dtype = Literal["auto", "float32", "bfloat16", "float16", "int8", "int4"]
LogLevel = Literal["debug", "info", "warning", "error"]


log = logging.getLogger(__name__)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DOMINO_", extra="ignore", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _retired_names(cls, data: Any) -> Any:
        # "Block size" means the KV cache's block now (DOMINO_KV_BLOCK_SIZE); the drafts cap that
        # was once DOMINO_BLOCK_SIZE is DOMINO_MAX_DRAFTS.
        if os.environ.get("DOMINO_BLOCK_SIZE") is not None:
            raise ValueError(
                "DOMINO_BLOCK_SIZE was retired: set DOMINO_MAX_DRAFTS to cap the drafts verified per step "
                "(DOMINO_KV_BLOCK_SIZE is the KV cache's block size, in tokens)"
            )
        given = data if isinstance(data, dict) else {}
        # The slot layout and its copying prefix cache are gone: KV storage is paged, and prompts that
        # begin alike share whole KV blocks.
        if os.environ.get("DOMINO_PREFIX_BLOCK_SIZE") is not None or "prefix_block_size" in given:
            raise ValueError(
                "DOMINO_PREFIX_BLOCK_SIZE was retired: prompts beginning alike share whole KV blocks of "
                "DOMINO_KV_BLOCK_SIZE tokens"
            )
        layout = os.environ.get("DOMINO_KV_LAYOUT", given.get("kv_layout"))
        if layout is not None and layout != "paged":
            raise ValueError(
                f"DOMINO_KV_LAYOUT={layout} was retired with the slot layout: KV storage is always paged "
                "(unset DOMINO_KV_LAYOUT)"
            )
        return data

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_cache_memory(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_memory(value)
            except ValueError as exc:
                raise ValueError(f"DOMINO_KV_CACHE_MEMORY: {exc}") from None
        return value

    @field_validator("kv_block_size")
    @classmethod
    def _kv_block_size(cls, value: int) -> int:
        if value < 1 or value & (value - 1):
            raise ValueError(f"DOMINO_KV_BLOCK_SIZE must be a power of two, got {value}")
        return value

    # -- model ------------------------------------------------------------------------------------
    target: str = Field("default", description="HF directory of the target, or 'default' (embedded SmolLM2-135M)")
    drafter: str | None = Field(
        None, description="drafter checkpoint directory (default: the one shipped for the default target)"
    )
    mode: Mode = Field("domino", description="speculation mode; falls back to 'ar' when no drafter fits")
    ngram: bool = Field(
        True,
        description="in domino/dflash modes, also propose n-gram copies from each request's own prompt and output "
        "(prompt lookup); the policy picks per request and step whichever is expected to pay more",
    )
    # Not "block_size": that is the drafter's own B (DrafterConfig.block_size), which this only caps.
    max_drafts: int | None = Field(
        None,
        ge=1,
        description="at most this many draft tokens verified per step (default: all the drafter proposes)",
    )
    draft_policy: Literal["adaptive", "fixed"] = Field(
        "adaptive",
        description="adaptive: drafts per step from the drafter's confidence and measured step costs (drafting "
        "pauses when it does not pay); fixed: always the full block",
    )
    dtype: Dtype = Field(
        "auto",
        description="auto: bf16 on CUDA and on CPUs with native bf16, else float32 (on a CPU the embedded "
        "default takes int4 or that dtype, whichever a start-up measurement finds faster); int8: the "
        "target's linear layers as weight-only int8 (CPU only; half bf16's bytes a token); int4: the "
        "decoder's as int4 in groups of 32 (a GGUF Q4_1's own blocks), the LM head int8 (CPU only); "
        "packed layers multiply bf16 rows, the rest runs bf16 with native bf16, else float32",
    )
    device: str = "auto"
    static_shapes: Literal["auto", "on", "off"] = Field(
        "auto",
        description="verify and draft in fixed (batch, tokens) buckets over preallocated buffers, with no host "
        "sync inside a step's forwards; auto: on for CUDA (padding is free there), off on the CPU",
    )
    cuda_graphs: bool = Field(
        True, description="with static shapes on CUDA, capture each bucket in a CUDA graph at start-up and replay it"
    )
    served_model_name: str | None = Field(None, description="model id clients send (default: derived from target)")
    tool_prompt: Literal["auto", "off"] = Field(
        "auto",
        description="tools for a chat template that cannot render them: auto describes them to the model in a "
        "system-prompt block in the Hermes <tool_call> format (app/tool_prompt.py), off refuses them with 400",
    )
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "none"] = Field(
        "auto",
        description="chat answers split into reasoning_content (the <think> block) and content: qwen3 (a leading "
        "<think>, or one the prompt opened), deepseek_r1 (the answer starts in the reasoning), none; auto: qwen3 "
        "when the chat template mentions <think>",
    )

    # -- scheduling -------------------------------------------------------------------------------
    max_batch_size: int = Field(8, ge=1, description="rows the engine runs together (running requests)")
    max_waiting: int = Field(
        64, ge=0, description="sequences admitted beyond the running rows; more are refused with 429"
    )
    max_model_len: int = Field(2048, ge=2, description="prompt + generated tokens per sequence")
    kv_cache_memory: str | None = Field(
        None,
        description="memory for keys and values: a size with a unit (512MiB, 4GiB), or a fraction of the memory "
        "left after the weights (0.9); requests are admitted while their blocks fit. Default: 2GiB on a CPU, "
        "0.9 on a GPU",
    )
    kv_block_size: int = Field(16, description="tokens per KV cache block, a power of two")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=0,
        description="chunked prefill: tokens one engine step may forward, decoding requests first (each its "
        "verify width), prompt chunks in what is left (at least a quarter of it a step), so that a long "
        "prompt shares steps with running streams; unset: chosen at start-up, the largest chunk a decode step of "
        "DOMINO_MAX_BATCH_SIZE rows carries for at most 1.5x its own time (timed with DOMINO_PROBE_COSTS, else "
        "128 on a CPU, 512 on a GPU); 0: off, whole prompts, each admission a step of its own",
    )
    prefix_cache_tokens: int = Field(
        4096,
        ge=0,
        description="whether prompts that begin alike (the system prompt, the chat template's markers) share "
        "their full KV blocks: 0 off, any other value on; the kept blocks are the free part of "
        "DOMINO_KV_CACHE_MEMORY",
    )
    probe_costs: bool = Field(
        True,
        description="time verify forwards (batch 1 and the largest, every verify width) and drafter blocks at "
        "start-up, so that the adaptive draft policy decides by this device's step costs from the first request "
        "(about 1-5 s on a CPU); off: a prior curve until steps are measured while serving",
    )
    max_n: int = Field(16, ge=1, description="largest accepted `n` (choices per prompt)")
    max_stop: int = Field(16, ge=0, description="most stop strings / stop token ids per request")

    # -- HTTP -------------------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, description="when set, /v1 routes need 'Authorization: Bearer <key>'")
    max_request_bytes: int = Field(1 << 20, ge=1, description="larger request bodies get 413")
    render_timeout: float = Field(
        5.0, gt=0, description="seconds a request's prompt may take to render and tokenize (400 beyond)"
    )
    drain_timeout: float = Field(30.0, ge=0, description="seconds in-flight requests may run on after SIGTERM")
    # Bounds on what one client can hold: connections, idle keep-alives, a body sent slowly.
    limit_concurrency: int = Field(
        1024, ge=1, description="open connections (and requests) at most; beyond, uvicorn answers 503"
    )
    keep_alive_timeout: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    body_read_timeout: float = Field(
        30.0, gt=0, description="seconds a client may take to send a request body (408 beyond)"
    )
    log_level: LogLevel = "info"
    replica_name: str | None = Field(
        None,
        description="name sent in the x-domino-replica response header (Ray Serve sets its replica id; the Helm "
        "chart the pod name); unset: no header",
    )

    # -- scaling out (Ray Serve; docs/design.md §5) ------------------------------------------------
    replicas: int | None = Field(
        None,
        ge=1,
        description="serve through Ray Serve with this many replicas, each owning one engine (and one GPU where "
        "CUDA is present); unset: one plain uvicorn process",
    )
    max_replicas: int | None = Field(
        None, ge=1, description="with --replicas: autoscale between --replicas and this many replicas"
    )
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="autoscaling target of requests in flight per replica (default: max_batch_size)"
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join (e.g. ray://head:10001 or auto); unset: start a local one"
    )
    replica_ready_timeout: float = Field(
        600.0,
        gt=0,
        description="with --replicas: seconds /health waits at start-up for every replica to serve; past it, the "
        "server is ready with the replicas it has and warns how many",
    )

    @model_validator(mode="after")
    def _empty_strings_mean_unset(self) -> Settings:
        # `DOMINO_API_KEY=` in an env file should disable auth, not require an empty token.
        if self.api_key == "":
            self.api_key = None
        if self.drafter == "":
            self.drafter = None
        if self.served_model_name == "":
            self.served_model_name = None
        if self.replica_name == "":
            self.replica_name = None
        if self.ray_address == "":
            self.ray_address = None
        return self

    @model_validator(mode="after")
    def _replica_bounds(self) -> Settings:
        if self.max_replicas is not None and self.max_replicas < (self.replicas or 1):
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas or 1})")
        return self

    @property
    def uses_ray(self) -> bool:
        """Serve through Ray Serve (a replica count given, or a cluster to join) rather than one uvicorn process."""
        return self.replicas is not None or self.max_replicas is not None or self.ray_address is not None

    @property
    def model_name(self) -> str:
        """The id in /v1/models and responses; requests must name it (or omit `model`)."""
        if self.served_model_name:
            return self.served_model_name
        if self.target == "default":
            return "SmolLM2-135M-Instruct"
        return Path(self.target.rstrip("/")).name or self.target
