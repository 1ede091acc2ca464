"""The vLLM connector's settings (``kv_connector_extra_config``) and the namespace of its
block hashes: what must agree for two engines to read each other's blocks, the model named
by its weights' content (:func:`model_fingerprint`), not by where they are.
"""

from __future__ import annotations

import importlib
import json
import os
import tomllib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from kvpool import errors

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked once at start-up (ConfigError names the setting)."""

    master: str
    config: str | None = None
    durable: bool | None = None  # None: the pool config's node.durable (kvpool.client.durable_copies)
    replicas: int | None = None  # None: the pool config's node.replicas
    load_timeout_s: float = 30.0
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    transport: str = "auto"
    plan: bool = True
    layers_per_pull: int = 0  # 0: auto
    # True: requests wait for their blocks outside the model's steps; False: their first step
    # waits, layer by layer; "auto": False when the blocks are read without the network, else True
    load_async: bool | Literal["auto"] = "auto"
    cpus: str | frozenset[int] = "auto"  # where the connector's threads run: "auto", "inherit" or CPU ids
    # Names the model's weights in the namespace instead of their content fingerprint
    # (model_fingerprint): engines with one model_id share blocks whatever their files say.
    model_id: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        from kvpool.config import check_master_address

        extra = dict(extra or {})
        known = {"master", "config", "durable", "replicas", "load_timeout_s", "on_load_failure", "transport", "plan",
                 "layers_per_pull", "load_async", "cpus", "model_id"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise errors.ConfigError(f"kv_connector_extra_config: unknown setting(s) {unknown}; known: {sorted(known)}")
        master = extra.get("master")
        if not isinstance(master, str) or not master:
            raise errors.ConfigError(
                'kv_connector_extra_config needs "master": "tcp://HOST:PORT" (the kvpool master, e.g. the one '
                "kvpool-server starts)")
        check_master_address(master)
        config = extra.get("config")
        if config is not None and not isinstance(config, str):
            raise errors.ConfigError('kv_connector_extra_config "config" must be the path of a kvpool TOML file')
        durable, replicas, timeout = extra.get("durable"), extra.get("replicas"), extra.get("load_timeout_s", 30.0)
        if durable is not None and not isinstance(durable, bool):
            raise errors.ConfigError(f'kv_connector_extra_config "durable" must be true or false, got {durable!r}')
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise errors.ConfigError(f'kv_connector_extra_config "replicas" must be an int >= 1, got {replicas!r}')
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise errors.ConfigError(f'kv_connector_extra_config "load_timeout_s" must be > 0, got {timeout!r}')
        on_failure = extra.get("on_load_failure", "recompute")
        if on_failure not in ("recompute", "fail"):
            raise errors.ConfigError(
                f'kv_connector_extra_config "on_load_failure" must be "recompute" or "fail", got {on_failure!r}')
        transport = extra.get("transport", "auto")
        if transport not in ("auto", "tcp"):
            raise errors.ConfigError(
                f'kv_connector_extra_config "transport" must be "auto" or "tcp", got {transport!r}')
        plan = extra.get("plan", True)
        if not isinstance(plan, bool):
            raise errors.ConfigError(f'kv_connector_extra_config "plan" must be true or false, got {plan!r}')
        per_pull = extra.get("layers_per_pull", "auto")
        if per_pull != "auto" and (isinstance(per_pull, bool) or not isinstance(per_pull, int) or per_pull < 1):
            raise errors.ConfigError(
                f'kv_connector_extra_config "layers_per_pull" must be "auto" or an int >= 1, got {per_pull!r}')
        load_async = extra.get("load_async", "auto")
        if not isinstance(load_async, bool) and load_async != "auto":
            raise errors.ConfigError(
                f'kv_connector_extra_config "load_async" must be "auto", true or false, got {load_async!r}')
        cpus = extra.get("cpus", "auto")
        if cpus not in ("auto", "inherit"):
            if not isinstance(cpus, list) or not cpus or any(
                    isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cpus):
                raise errors.ConfigError(
                    f'kv_connector_extra_config "cpus" must be "auto", "inherit" or a list of CPU ids, got {cpus!r}')
            cpus = frozenset(cpus)
        model_id = extra.get("model_id")
        if model_id is not None and (not isinstance(model_id, str) or not model_id.strip()):
            raise errors.ConfigError(
                f'kv_connector_extra_config "model_id" must be a non-empty string naming the weights, got {model_id!r}')
        return cls(master, config, durable, replicas, float(timeout), "fail" if on_failure == "fail" else "recompute",
                   transport, plan, 0 if per_pull == "auto" else per_pull, load_async, cpus, model_id)

    def pool_config(self) -> dict[str, Any]:
        """The kvpool settings of this engine's own pool: the TOML's, as a mapping, so that one
        naming no ``pool.name`` opens a pool of its own (``client-<pid>``) and never collides
        with a kvpool-server or another engine on the host."""
        if not self.config:
            return {}
        try:
            with open(self.config, "rb") as fh:
                return tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise errors.ConfigError(f'kv_connector_extra_config "config": cannot read {self.config}: {exc}') from None


# Model identity (model_fingerprint): how much of a checkpoint is read at start.
_WHOLE_FILE_BYTES = 64 << 20  # a file up to this size is hashed whole (configs, code, small models)
_SPREAD_WINDOWS = 32  # a larger one: this many windows, evenly spread from its first byte to its last,
_SPREAD_WINDOW_BYTES = 64 << 10  # of 64 KiB each,
_TENSOR_EDGE_BYTES = 4 << 10  # and in a safetensors file the first and last 4 KiB of each tensor
_TENSORS_SAMPLED = 256  # (of at most this many tensors a file, evenly spread over them)
_SAFETENSORS_HEADER_MAX_BYTES = 100 << 20  # the format's own limit
# Files of a model directory that do not decide its KV cache: the tokenizer decides the token ids,
# and the keys are hashes of the token ids already, so equal ids under equal weights are equal KV
# whatever tokenizer produced them; generation defaults decide sampling only; the rest is prose.
_NOT_THE_MODEL = frozenset({"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                            "added_tokens.json", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                            "generation_config.json", "chat_template.json", "LICENSE", "NOTICE"})
_NOT_THE_MODEL_SUFFIXES = (".md", ".txt", ".jinja", ".tiktoken", ".png", ".jpg", ".jpeg", ".gif", ".pdf")
# vLLM loads *.safetensors when a model has any, else *.bin: the other format is not what it runs.
_TORCH_WEIGHTS_SUFFIXES = (".bin", ".pt", ".pth", ".bin.index.json")


def model_fingerprint(model: str, revision: str | None = None, *, download_dir: str | None = None) -> str:
    """Names the weights by their content, not by where they are: two copies of one checkpoint
    at different paths, with different modification times, get one fingerprint (and share
    blocks); a checkpoint with other weights, another header or another config gets another.

    ``model`` is vLLM's ``model_config.model``: a local directory (or a single weights file, as
    a GGUF model is) is fingerprinted by :func:`content_digest`. A hub id is looked up in the
    local Hugging Face cache (``download_dir`` if vLLM was given one) at ``revision``: vLLM has
    downloaded the weights there before the connector starts, so that snapshot directory is
    fingerprinted by content too (a hub id and a local copy of the same files share blocks).
    Without a local snapshot the fingerprint is ``hub:ID@REVISION`` (``main`` when none is given:
    a moving name; pin a revision, or set ``model_id``). An unreadable file of the model is one
    :class:`~kvpool.errors.ConfigError` naming it. The connector's ``model_id`` setting replaces
    this fingerprint (:func:`namespace_of`)."""
    if os.path.exists(model):
        return "content-v1:" + content_digest(model)
    snapshot = _hub_snapshot(model, revision, download_dir)
    if snapshot is not None:
        return "content-v1:" + content_digest(snapshot)
    return f"hub:{model}@{revision or 'main'}"


def content_digest(path: str, *, whole_file_bytes: int = _WHOLE_FILE_BYTES) -> str:
    """The content of a model directory (its top-level files, by name) or of one weights file,
    as 32 hex digits (xxh3-128), computed cheaply enough for every engine process to do at start.

    What decides a block's bytes is the weights and the model's configuration (``config.json``,
    quantization configs, custom model code): those are read. Tokenizer files, generation
    defaults, prose (``*.md``, ``*.txt``, licences) and hidden files are left out (see
    ``_NOT_THE_MODEL``), and beside ``*.safetensors`` the ``*.bin`` / ``*.pt`` weights vLLM does
    not load are too, so a copy that lacks or adds those still shares blocks; a copy that lacks
    or adds any other file is another model (a miss, never a wrong block). Subdirectories are
    not read (vLLM loads a model's top-level weights).

    A file of up to ``whole_file_bytes`` (64 MiB) is hashed whole. A larger one is sampled:
    its size, its safetensors header (every tensor's name, dtype, shape and offsets), the first
    and last 4 KiB of each of its tensors (of up to 256 tensors a file, evenly spread) and 32
    windows of 64 KiB spread evenly from its first byte to its last; a ``.bin``, ``.gguf`` or
    other large file: its size and the 32 windows. Measured on this VM's disk (page cache
    dropped) and from the page cache: a 1.3 GiB shard of 36 Llama tensors, 2.4 MiB read, in
    8-13 ms / 0.5 ms; a 1 GiB shard of 4,096 expert tensors, 4.6 MiB in 542 reads, in 50 ms /
    12-19 ms. Hashing the whole 1.3 GiB took 0.5-1.3 s / 90-130 ms, in every engine process
    (scheduler and each worker) at every start: tens of seconds to minutes for a 70B model.

    The trade-off: any change of a tensor's name, dtype, shape or place, of a file's size, of a
    sampled tensor's first or last 4 KiB, or of a sampled window is seen, and so is a fine-tune
    or a merge of the tensors sampled (it changes nearly every element of each tensor it
    touches, edges included). A change confined to bytes no window covers is not: one weight
    edited in place inside a large tensor is seen with a chance of about the sampled share of
    its file (2.4 MiB of 1.3 GiB: 1 in 560), and otherwise that copy shares blocks with the
    original; so may a file that changed only tensors left out of the 256. Whoever edits
    weights in place, or wants no doubt, names the model with the connector's ``model_id``
    setting (one name per set of weights) instead."""
    hasher = xxhash.xxh3_128()
    if os.path.isdir(path):
        for name in _model_files(path):
            hasher.update(f"{name}\0".encode())
            hasher.update(_file_digest(os.path.join(path, name), whole_file_bytes))
    else:
        hasher.update(_file_digest(path, whole_file_bytes))
    return hasher.hexdigest()


def _model_files(directory: str) -> list[str]:
    """The top-level files of a model directory that decide its KV cache (see :func:`content_digest`)."""
    try:
        names = sorted(e.name for e in os.scandir(directory) if e.is_file() and not e.name.startswith("."))
    except OSError as exc:
        raise errors.ConfigError(f"cannot read the model directory {directory} to name the model: {exc} "
                                 '(or name it with the connector\'s "model_id" setting)') from None
    names = [n for n in names if n not in _NOT_THE_MODEL and not n.endswith(_NOT_THE_MODEL_SUFFIXES)]
    if any(n.endswith(".safetensors") for n in names):
        names = [n for n in names if not n.endswith(_TORCH_WEIGHTS_SUFFIXES)]
    return names


def _file_digest(path: str, whole_file_bytes: int) -> bytes:
    """One file's content: whole up to ``whole_file_bytes``, else sampled (:func:`content_digest`)."""
    hasher = xxhash.xxh3_128()
    try:
        with open(path, "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            hasher.update(size.to_bytes(8, "little"))
            if size <= whole_file_bytes:
                buffer = memoryview(bytearray(min(size, 8 << 20) or 1))
                while read := fh.readinto(buffer):
                    hasher.update(buffer[:read])
                return hasher.digest()
            for start, stop in _sampled_ranges(fh.fileno(), size, path.endswith(".safetensors")):
                hasher.update(start.to_bytes(8, "little"))
                hasher.update(os.pread(fh.fileno(), stop - start, start))
    except OSError as exc:
        raise errors.ConfigError(f"cannot read {path} to name the model: {exc} "
                                 '(or name it with the connector\'s "model_id" setting)') from None
    return hasher.digest()


def _sampled_ranges(fd: int, size: int, safetensors: bool) -> list[tuple[int, int]]:
    """The byte ranges of a large file that its fingerprint reads, sorted and merged."""
    window = min(_SPREAD_WINDOW_BYTES, size)
    ranges = [(at, at + window) for at in
              sorted({i * (size - window) // (_SPREAD_WINDOWS - 1) for i in range(_SPREAD_WINDOWS)})]
    layout = _safetensors_layout(fd, size) if safetensors else None
    if layout is not None:
        data_start, spans = layout
        ranges.append((0, data_start))  # the length and the JSON header
        if len(spans) > _TENSORS_SAMPLED:
            spans = [spans[i * len(spans) // _TENSORS_SAMPLED] for i in range(_TENSORS_SAMPLED)]
        for begin, end in spans:
            begin, end = data_start + begin, data_start + end
            ranges += [(begin, min(end, begin + _TENSOR_EDGE_BYTES)), (max(begin, end - _TENSOR_EDGE_BYTES), end)]
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _safetensors_layout(fd: int, size: int) -> tuple[int, list[tuple[int, int]]] | None:
    """Where a safetensors file's data starts and each tensor's (begin, end) from there, in file
    order; None when the file is not one (it is then sampled as any other file)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    header_bytes = int.from_bytes(head, "little")
    if header_bytes > min(_SAFETENSORS_HEADER_MAX_BYTES, size - 8):
        return None
    try:
        header = json.loads(os.pread(fd, header_bytes, 8))
        spans = sorted((int(entry["data_offsets"][0]), int(entry["data_offsets"][1]))
                       for name, entry in header.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    data_start = 8 + header_bytes
    if any(not 0 <= begin <= end <= size - data_start for begin, end in spans):
        return None
    return data_start, spans


def _hub_snapshot(model: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The local snapshot directory of hub model ``model`` at ``revision`` (no network), or None."""
    try:
        # (imported by name: where .ci/run type-checks, vLLM and the hub client are not installed)
        hub: Any = importlib.import_module("huggingface_hub")
        path = hub.snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (ImportError, OSError, ValueError):  # not installed, not cached, not a hub id
        return None
    return path if isinstance(path, str) and os.path.isdir(path) else None


def namespace_of(vllm_config: VllmConfig, tp_rank: int = 0) -> str:
    """What must agree for two engines to read each other's blocks (see
    :mod:`kvpool.integrations.vllm`): the model (the ``model_id`` setting of
    ``kv_connector_extra_config`` when given, else :func:`model_fingerprint`), how its weights
    are read (vLLM's ``quantization`` and ``hf_overrides``), the dtype, the cache dtype, the
    block size, the layout of a block (device kind, the CPU's vector ISA on CPU) and the
    parallel ranks. ``model_id`` names the weights only: the rest is added to it all the same."""
    import torch

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    device = str(getattr(vllm_config.device_config, "device_type", "")) or "cpu"
    isa = torch.backends.cpu.get_cpu_capability() if device == "cpu" else ""
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None) or {}
    model_id = extra.get("model_id")
    if isinstance(model_id, str) and model_id:
        weights = f"id:{model_id}"
    else:
        download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
        weights = model_fingerprint(str(model.model), model.revision, download_dir=download_dir)
    overrides = getattr(model, "hf_overrides", None)
    read_as = [f"q-{model.quantization}"] if getattr(model, "quantization", None) else []
    if isinstance(overrides, dict) and overrides:  # config values set over config.json's
        read_as.append("hf-" + json.dumps(overrides, sort_keys=True, default=str))
    elif callable(overrides):  # a function of the config: named by where it is defined
        read_as.append(f"hf-{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}")
    return "|".join(["vllm-blocks-v1", weights, *read_as, str(model.dtype), str(cache.cache_dtype),
                     f"bs{cache.block_size}", f"{device}{'-' + isa if isa else ''}",
                     f"tp{tp_rank}/{parallel.tensor_parallel_size}", f"pp{parallel.pipeline_parallel_size}"])
