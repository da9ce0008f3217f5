"""Load a target (HF causal LM + tokenizer) and a drafter, and assemble an Engine."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from model.engine.config import EngineConfig
from model.engine.engine import Engine
from model.load.checkpoint import load_drafter
from model.nn.drafter import Drafter
from model.nn.packed import cpu_has_native_bf16
from model.nn.target import TargetModel

log = logging.getLogger(__name__)

DEFAULT_TARGET = "default"
REPO_ROOT = Path(__file__).resolve().parents[2]  # model/load/loading.py -> the checkout


def shipped_drafter_dir(name: str) -> Path:
    """A drafter this project ships (drafters/README.md): `drafters/<name>` next to the source (a
    checkout or editable install), else `<prefix>/share/domino-serve/drafters/<name>` where a wheel
    install puts it (pyproject.toml's data-files)."""
    for base in (REPO_ROOT / "drafters", Path(sys.prefix) / "share" / "domino-serve" / "drafters"):
        if (base / name / "config.json").is_file():
            return base / name
    return REPO_ROOT / "drafters" / name


# The drafters this project trained for the embedded default target.
DEFAULT_DRAFTER_DIR = shipped_drafter_dir("smollm2-135m-domino")
DEFAULT_DFLASH_DRAFTER_DIR = shipped_drafter_dir("smollm2-135m-dflash")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weight formats beyond a dtype: packed weights (model/nn/packed.py) on the CPU, bf16 activations
# (float32 on CPUs without native bf16: resolve_dtype).
PACKED = {"int8": torch.bfloat16, "int4": torch.bfloat16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16 matmuls, else fp32.

    On a CPU with AVX512-BF16 a bf16 target is not only lighter: a forward over 2-9 tokens costs
    about what one over a single token does (fp32 GEMMs slow down with every extra row), which is
    what lets a verify forward pay for its drafts (docs/benchmarks.md, "CPU verify cost")."""
    if dtype == "auto":
        if device.startswith("cuda") or (device == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    if dtype in PACKED:
        if device != "cpu":
            raise ValueError(f"dtype {dtype!r} (DOMINO_DTYPE) packs weights for the CPU's kernels; {device} has none")
        # Without native bf16 only the packed kernels take bf16 (their vectorized path); the rest,
        # wide inputs included, runs fp32, which such a CPU multiplies ~3x faster than bf16.
        return PACKED[dtype] if cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + sorted(PACKED)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def load_target_as(
    name_or_path: str, dtype: str, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, torch.dtype]:
    """`load_target` from a `DOMINO_DTYPE` value: the activations' dtype resolved (`resolve_dtype`)
    and the weights packed where it asks for it (`pack_weights`); the model, its tokenizer and that
    dtype (what a drafter beside it runs in)."""
    torch_dtype = resolve_dtype(dtype, device)
    if dtype == "auto" and device == "cpu" and name_or_path == DEFAULT_TARGET:
        # The embedded default's GGUF holds Q4_1 blocks: int4 is the file itself; measure which pays.
        from model.load.cpu_format import choose_cpu_format

        model, tokenizer = load_target(name_or_path, torch.float32, device)
        model, chosen, timings = choose_cpu_format(model, torch_dtype)
        log.info(
            "dtype auto: %s (%s; a one-token forward took %s; int4 packs the GGUF's own Q4_1 blocks and "
            "multiplies them on bf16 rows)",
            f"int4 weights, {_name(torch_dtype)} activations" if chosen == "int4" else _name(torch_dtype),
            "native bf16 on this CPU" if cpu_has_native_bf16() else "no native bf16 on this CPU",
            ", ".join(f"{ms:.1f} ms {name}" for name, ms in timings.items()),
        )
        return model, tokenizer, torch_dtype
    if dtype not in PACKED:
        model, tokenizer = load_target(name_or_path, torch_dtype, device)
        return model, tokenizer, torch_dtype
    # Packed from the float32 weights (for the embedded default: the GGUF's values exactly, which
    # int4 re-packs into the file's own blocks).
    model, tokenizer = load_target(name_or_path, torch.float32, device)
    model, packed = pack_as(model, dtype, torch_dtype)
    log.info("%d linear layers packed as weight-only %s (%s activations)", packed, dtype, _name(torch_dtype))
    return model, tokenizer, torch_dtype


def pack_as(model: PreTrainedModel, dtype: str, activations: torch.dtype) -> tuple[PreTrainedModel, int]:
    """A float32 model's weights packed (`pack_weights`), then everything left over in
    `activations`; the model and the count packed. A float32 model is left as it is: `.to` would
    also cast the kernels' bf16 scales."""
    packed = pack_weights(model, dtype)
    if activations != torch.float32:
        model = model.to(activations)
    return model, packed


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_weights(model: PreTrainedModel, dtype: str) -> int:
    """`dtype` 'int8': the model's linear layers become weight-only int8; 'int4': the decoder's
    become int4 in groups of 32 (GGUF Q4_1's blocks) and the LM head int8 (the GGUF keeps it in
    8 bits, Q8_0); model/nn/packed.py. The LM head keeps its dense weight for a drafter to borrow.
    Other dtypes: nothing. The count packed."""
    if dtype not in PACKED:
        return 0
    from model.nn.packed import Int4Linear, Int8Linear, pack_linears

    head = model.get_output_embeddings()
    if dtype == "int8":
        return pack_linears(model, Int8Linear, dense=head)
    count = pack_linears(model.get_decoder(), Int4Linear)
    model.set_output_embeddings(Int8Linear(head, keep_dense=True))
    return count + 1


def match_packing(target: PreTrainedModel, drafter: Drafter) -> int:
    """A drafter beside an int4 target packs its own layers as int4 too (its drafts cost what a
    fraction of a target step does only if it reads few bytes as well); the count packed."""
    from model.nn.packed import Int4Linear

    if not any(isinstance(m, Int4Linear) for m in target.modules()):
        return 0
    return drafter.pack(Int4Linear)


def load_target(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """An HF causal LM and its tokenizer; `default` is the embedded SmolLM2-135M-Instruct."""
    if name_or_path == DEFAULT_TARGET:
        from model.load.default_model import ensure_default_target

        name_or_path = str(ensure_default_target())
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    return model.to(device).eval(), tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the generation config (may be a list) and the tokenizer."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def resolve_checkpoint(name_or_path: str) -> Path:
    """A local directory, or a Hugging Face model id looked up in the local HF cache (never downloaded
    here: serve with HF_HUB_OFFLINE=1 and a mounted cache, or download beforehand)."""
    path = Path(name_or_path).expanduser()
    if path.exists() or name_or_path.count("/") != 1 or name_or_path.startswith((".", "/")):
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - report as a missing checkpoint
        raise FileNotFoundError(
            f"drafter {name_or_path!r} is neither a directory nor a model in the local Hugging Face cache "
            f"(HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}): {exc}"
        ) from None


def default_drafter_path(mode: str) -> Path | None:
    path = DEFAULT_DFLASH_DRAFTER_DIR if mode == "dflash" else DEFAULT_DRAFTER_DIR
    if mode == "dflash" and not path.exists():
        path = DEFAULT_DRAFTER_DIR  # Domino checkpoint with its head off
    return path if (path / "model.safetensors").exists() else None


def build_engine(
    target: str = DEFAULT_TARGET,
    drafter: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    config: EngineConfig | None = None,
    **overrides: Any,
) -> tuple[Engine, PreTrainedTokenizerBase]:
    """Load everything a server needs. With the default target and no drafter given, the drafter
    shipped in drafters/ is used; where none fits, the engine falls back to `ar` and logs why.
    `overrides` replace fields of `config` (EngineConfig's names); the EOS ids come from the model."""
    config = replace(config or EngineConfig(), **overrides)
    mode = config.mode
    dev = resolve_device(device)
    model, tokenizer, torch_dtype = load_target_as(target, dtype, dev)
    draft_model: Drafter | None = None
    if mode not in ("ar", "ngram"):  # ngram needs no drafter
        path: Path | None = resolve_checkpoint(drafter) if drafter else None
        if path is None and target == DEFAULT_TARGET:
            path = default_drafter_path(mode)
        if path is None:
            log.warning("no drafter given for mode %r: serving in 'ar' mode (plain decoding)", mode)
            mode = "ar"
        else:
            draft_model = load_drafter(path, dtype=torch_dtype, device=dev, target_config=model.config)
            match_packing(model, draft_model)
            if mode == "domino" and not draft_model.config.has_head:
                log.warning("drafter %s has no Domino head: serving in 'dflash' mode", path)
                mode = "dflash"
    config = replace(config, mode=mode, eos_token_ids=tuple(eos_token_ids(model, tokenizer)))
    engine = Engine(TargetModel(model), draft_model, config)
    return engine, tokenizer


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], **template_kwargs: object
) -> list[int]:
    """Token ids of a chat rendered with the target's template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
