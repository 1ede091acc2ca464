"""The vLLM connector's model identity (kvpool.integrations.vllm_settings.model_fingerprint):
the weights by their content, not their path. No vLLM needed: a tiny fake checkpoint, a real
safetensors file written by hand (8-byte little-endian header length, JSON header, data)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvpool import errors
from kvpool.integrations.vllm_settings import Settings, content_digest, model_fingerprint, namespace_of

# Two tensors of 1 MiB each and a small one: the file (~2 MiB) is hashed whole by default, and
# sampled when a test sets whole_file_bytes=0.
TENSORS = {"model.embed.weight": ("BF16", (512, 1024)), "model.layers.0.q.weight": ("BF16", (1024, 512)),
           "model.norm.weight": ("BF16", (512,))}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], seed: int = 0) -> dict[str, int]:
    """A safetensors file of random 2-byte elements; each tensor's first byte in the file."""
    rng = np.random.default_rng(seed)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at, blobs = 0, []
    for name, (dtype, shape) in tensors.items():
        nbytes = 2 * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        blobs.append(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
        at += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 64)  # padded with spaces, as safetensors' own writer aligns it
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))
    data_start = 8 + len(encoded)
    return {name: data_start + entry["data_offsets"][0]  # type: ignore[index]
            for name, entry in header.items() if name != "__metadata__"}


def make_checkpoint(directory: Path, tensors: dict[str, tuple[str, tuple[int, ...]]] = TENSORS,
                    config: dict[str, object] | None = None) -> dict[str, int]:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"],
                                                                 "hidden_size": 1024, "num_hidden_layers": 1}))
    (directory / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    return write_safetensors(directory / "model.safetensors", tensors)


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))


def copy_elsewhere(source: Path, target: Path) -> Path:
    """A copy as ``cp -r`` makes it (no -p): new path, new modification times."""
    shutil.copytree(source, target, copy_function=shutil.copyfile)
    for f in target.iterdir():
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    return target


@pytest.mark.parametrize("whole_file_bytes", [64 << 20, 0], ids=["hashed-whole", "sampled"])
def test_copies_of_a_checkpoint_share_a_fingerprint_and_changed_weights_header_or_config_do_not(
        tmp_path: Path, whole_file_bytes: int) -> None:
    original = tmp_path / "a" / "llama"
    starts = make_checkpoint(original)
    try:  # the hand-written file is a real safetensors file
        from safetensors import safe_open
    except ImportError:
        pass
    else:
        with safe_open(str(original / "model.safetensors"), framework="numpy") as reader:
            assert set(reader.keys()) == set(TENSORS) and reader.metadata() == {"format": "pt"}

    def fp(path: Path) -> str:
        return content_digest(str(path), whole_file_bytes=whole_file_bytes)

    base = fp(original)
    assert fp(copy_elsewhere(original, tmp_path / "b" / "other-name")) == base
    os.utime(original / "model.safetensors", ns=(5, 5))  # a new modification time alone
    assert fp(original) == base
    # Files that do not decide the KV cache: another tokenizer config, a README, hidden files.
    copy = copy_elsewhere(original, tmp_path / "tok")
    (copy / "tokenizer_config.json").write_text('{"add_bos_token": false}')
    (copy / "README.md").write_text("notes")
    (copy / ".cache").mkdir()
    assert fp(copy) == base

    # One changed weight byte inside a sampled region: a tensor's first byte.
    changed = copy_elsewhere(original, tmp_path / "weight")
    flip_byte(changed / "model.safetensors", starts["model.layers.0.q.weight"])
    assert fp(changed) != base
    # Another dtype or shape in the header, the same size and the same bytes after it.
    for name, spec in [("dtype", ("F16", (1024, 512))), ("shape", ("BF16", (512, 1024)))]:
        other = tmp_path / f"header-{name}"
        make_checkpoint(other, {**TENSORS, "model.layers.0.q.weight": spec})
        assert (other / "model.safetensors").stat().st_size == (original / "model.safetensors").stat().st_size
        assert fp(other) != base, name
    # Another config.json; an added file that could decide the KV (custom model code).
    other = copy_elsewhere(original, tmp_path / "config")
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
                                                   "num_hidden_layers": 1, "rope_theta": 1e6}))
    assert fp(other) != base
    other = copy_elsewhere(original, tmp_path / "code")
    (other / "modeling_custom.py").write_text("# trust_remote_code\n")
    assert fp(other) != base


def test_a_large_file_is_sampled_and_a_byte_outside_every_window_is_not_seen_unless_hashed_whole(
        tmp_path: Path) -> None:
    """The documented limit of sampling: a change confined to bytes no window covers (here the
    middle of a tensor, between two spread windows) leaves the fingerprint as it was; the same
    file under the whole-file threshold (64 MiB by default) is hashed whole and it is seen."""
    original = tmp_path / "a"
    starts = make_checkpoint(original)
    path = original / "model.safetensors"
    size = path.stat().st_size
    with path.open("rb") as fh:
        from kvpool.integrations.vllm_settings import sampled_ranges

        ranges = sampled_ranges(fh.fileno(), size, True)
    assert sum(stop - start for start, stop in ranges) < size  # sampled, not read whole
    # The first byte no window covers: inside a tensor (the header is read whole).
    middle = next(stop for (_, stop), (start, _) in zip(ranges, ranges[1:]) if start > stop)
    assert starts["model.embed.weight"] < middle < size and not any(a <= middle < b for a, b in ranges)
    sampled = content_digest(str(original), whole_file_bytes=0)
    whole = content_digest(str(original))
    changed = copy_elsewhere(original, tmp_path / "b")
    flip_byte(changed / "model.safetensors", middle)
    assert content_digest(str(changed), whole_file_bytes=0) == sampled  # not seen: the trade-off
    assert content_digest(str(changed)) != whole  # hashed whole: seen
    # Every byte of a sampled window counts (here the last one of the file).
    flip_byte(changed / "model.safetensors", size - 1)
    assert content_digest(str(changed), whole_file_bytes=0) != sampled


def test_the_fingerprint_of_a_path_a_single_file_a_hub_id_and_unreadable_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.integrations import vllm_settings

    model = tmp_path / "llama"
    make_checkpoint(model)
    fingerprint = model_fingerprint(str(model))
    assert fingerprint.startswith("content-v1:") and str(tmp_path) not in fingerprint
    # A single weights file (a GGUF model) by its content; a hub id without a local snapshot
    # by its revision.
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    shutil.copyfile(gguf, tmp_path / "copied.gguf")
    assert model_fingerprint(str(gguf)) == model_fingerprint(str(tmp_path / "copied.gguf"))
    empty_cache = tmp_path / "hf-cache-empty"
    empty_cache.mkdir()
    assert model_fingerprint("org/model", "abc", download_dir=str(empty_cache)) == "hub:org/model@abc"
    assert model_fingerprint("org/model", None, download_dir=str(empty_cache)) == "hub:org/model@main"
    # A hub id whose snapshot vLLM downloaded (Hugging Face's cache layout) is the same model
    # as a local copy of the same files.
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hf-cache"
    repo = cache / "models--org--llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    copy_elsewhere(model, repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567")
    assert model_fingerprint("org/llama", None, download_dir=str(cache)) == fingerprint
    # Weights the process cannot read: one ConfigError naming the file and model_id.
    def refused(path: str, *args: object, **kwargs: object) -> object:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(vllm_settings, "open", refused, raising=False)
    with pytest.raises(errors.ConfigError, match=r"cannot read .*config\.json to name the model.*model_id"):
        model_fingerprint(str(model))


def test_model_id_names_the_weights_and_the_rest_of_the_namespace_stays(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # (namespace_of asks torch for the CPU's vector ISA)
    model = tmp_path / "llama"
    make_checkpoint(model)

    def vllm_config(path: Path, extra: dict[str, object], **model_config: object) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(**{"model": str(path), "revision": None, "dtype": "torch.bfloat16",
                                            "quantization": None, "hf_overrides": {}, **model_config}),
            cache_config=SimpleNamespace(cache_dtype="auto", block_size=128),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            device_config=SimpleNamespace(device_type="cuda"), load_config=SimpleNamespace(download_dir=None),
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))

    def ns(path: Path, extra: dict[str, object] | None = None, **model_config: object) -> str:
        return namespace_of(vllm_config(path, extra or {"master": "tcp://h:1"}, **model_config))  # type: ignore[arg-type]

    copy = copy_elsewhere(model, tmp_path / "copy")
    assert ns(model) == ns(copy)
    flip_byte(copy / "model.safetensors", (copy / "model.safetensors").stat().st_size - 1)  # another weight
    assert ns(model) != ns(copy)
    named = {"master": "tcp://h:1", "model_id": "llama-3-8b-instruct@v2"}
    assert ns(model, named) == ns(copy, named)  # the operator's name overrides the fingerprint
    assert "id:llama-3-8b-instruct@v2|" in ns(model, named)
    assert ns(model, named) != ns(model, {**named, "model_id": "other"})
    assert ns(model, named).split("|")[2:] == ns(model).split("|")[2:]  # dtype, layout, ranks still agree
    assert ns(model).endswith("|tp1|pp1")  # the engine's parallel sizes; a rank's share: object_key
    # How the weights are read is part of the model: quantization at load, config overrides.
    assert ns(model, quantization="fp8") != ns(model)
    assert ns(model, hf_overrides={"rope_theta": 1e6}) != ns(model)
    assert Settings.from_extra(named).model_id == "llama-3-8b-instruct@v2"
    assert Settings.from_extra({"master": "tcp://h:1"}).model_id is None
    for bad in ("", "  ", 7):
        with pytest.raises(errors.ConfigError, match='"model_id"'):
            Settings.from_extra({"master": "tcp://h:1", "model_id": bad})


def _request(request_id: str, tokens: list[int], **extras: object) -> object:
    """vLLM's own Request (its extras: ``lora_request``, ``mm_features``, ``cache_salt``, ...)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, tokens, SamplingParams(max_tokens=1), None, **extras)  # type: ignore[arg-type]


def test_a_requests_keys_tell_apart_what_vllms_prefix_cache_tells_apart() -> None:
    """LoRA adapter, multimodal inputs (each with its place) and ``cache_salt`` are in a
    request's block keys, as in vLLM's own block hashes: the same tokens with other (or no)
    extras never share a key; with the same extras they do. A request whose extras cannot be
    read as vLLM 0.32 gives them (or one with prompt embeddings) gets no keys at all. vLLM's own
    Request, LoRARequest, MultiModalFeatureSpec and PlaceholderRange."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from kvpool.hashing import prefix_hashes
    from kvpool.integrations.vllm_settings import request_keys

    block, ns = 16, "test-namespace"
    tokens = [7] * 8 + list(range(100, 100 + 3 * block))  # 3.5 blocks; placeholder tokens 7, 7, ...

    def keys(**extras: object) -> list[bytes]:
        got = request_keys(_request("r", tokens, **extras), block, ns)
        assert got is not None and len(got) == 3
        return got

    def image(identifier: str, offset: int, length: int = 8) -> MultiModalFeatureSpec:
        return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                     mm_position=PlaceholderRange(offset=offset, length=length))

    def disjoint(a: list[bytes], b: list[bytes], shared: int = 0) -> bool:
        """The first ``shared`` keys equal, every later one different (a prefix: once apart, apart)."""
        return a[:shared] == b[:shared] and all(x != y for x, y in zip(a[shared:], b[shared:]))

    plain = keys()
    assert plain == prefix_hashes(tokens, block, namespace=ns)  # no extras: the token prefix hashes
    # LoRA: named by its name and path, not the int id each engine numbers its own way.
    lora_a = keys(lora_request=LoRARequest("adapter-a", 1, "/adapters/a"))
    assert keys(lora_request=LoRARequest("adapter-a", 7, "/adapters/a")) == lora_a
    lora_b = keys(lora_request=LoRARequest("adapter-b", 1, "/adapters/b"))
    repointed = keys(lora_request=LoRARequest("adapter-a", 1, "/adapters/a-v2"))
    for one, other in [(lora_a, plain), (lora_b, plain), (lora_a, lora_b), (repointed, lora_a)]:
        assert disjoint(one, other)
    # cache_salt: isolates from block 0 on; an empty salt is none (as in vLLM).
    salted = keys(cache_salt="tenant-1")
    assert keys(cache_salt="tenant-1") == salted and keys(cache_salt="") == plain
    assert disjoint(salted, plain) and disjoint(salted, keys(cache_salt="tenant-2"))
    assert disjoint(keys(cache_salt="tenant-1", lora_request=LoRARequest("adapter-a", 1, "/adapters/a")), lora_a)
    # Multimodal: the same placeholder tokens with another image never share a block that
    # holds it, nor any after; blocks before the first image are the plain ones (vLLM shares them too).
    with_a = keys(mm_features=[image("image-a", block + 4)])
    assert with_a == keys(mm_features=[image("image-a", block + 4)])
    assert disjoint(with_a, keys(mm_features=[image("image-b", block + 4)]), shared=1)
    assert disjoint(with_a, plain, shared=1)
    assert disjoint(with_a, keys(mm_features=[image("image-a", block + 5)]), shared=1)  # moved inside its block
    assert disjoint(with_a, keys(mm_features=[image("image-a", block + 4, length=9)]), shared=1)
    two = keys(mm_features=[image("image-a", 0), image("image-b", 2 * block - 4)])  # the second spans blocks 1-2
    assert disjoint(two, keys(mm_features=[image("image-a", 0), image("image-c", 2 * block - 4)]), shared=1)
    assert disjoint(two, keys(mm_features=[image("image-a", 0)]), shared=1)
    assert keys(mm_features=[image("image-a", 0), image("image-b", 2 * block - 4)]) == two
    assert disjoint(keys(mm_features=[image("image-a", 0)]), keys(mm_features=[image("image-a", 0)],
                                                                   lora_request=LoRARequest("adapter-a", 1, "/a")))
    # Extras that cannot be read as vLLM 0.32 gives them: kvpool stays out of the request.
    assert request_keys(SimpleNamespace(request_id="r", prompt_token_ids=tokens), block, ns) is None
    assert request_keys(_request("r", tokens, prompt_embeds=torch.zeros(len(tokens), 4)), block, ns) is None
    for broken in (LoRARequest("", 1, "/a"), SimpleNamespace(lora_int_id=1)):
        assert request_keys(_request("r", tokens, lora_request=broken), block, ns) is None
    assert request_keys(_request("r", tokens, cache_salt=b"bytes"), block, ns) is None
    for odd in (SimpleNamespace(identifier=None, mm_position=PlaceholderRange(offset=0, length=4)),
                SimpleNamespace(identifier="image-a", mm_position=None),
                SimpleNamespace(identifier="image-a", mm_position=PlaceholderRange(offset=-1, length=4)),
                SimpleNamespace(identifier="image-a", mm_position=PlaceholderRange(offset=0, length=0))):
        assert request_keys(_request("r", tokens, mm_features=[odd]), block, ns) is None


def test_each_parallel_rank_keys_its_own_share_of_a_block_and_context_parallelism_is_refused() -> None:
    """vLLM's own ParallelConfig: every tensor- and pipeline-parallel rank has its own object
    key of a block (an engine of one rank: the block's key itself); decode and prefill context
    parallelism are refused with one ConfigError."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.config import ParallelConfig

    from kvpool.integrations.vllm_settings import check_parallel, object_key, rank_tag, rank_tags

    key = b"k" * 16
    one = ParallelConfig()
    assert rank_tag(one, 0) is None and rank_tags(one) == [] and object_key(key, None) == key
    check_parallel(one)
    tp2 = ParallelConfig(tensor_parallel_size=2)
    assert rank_tags(tp2) == [rank_tag(tp2, 0), rank_tag(tp2, 1)] == [b"tp0/2|pp0/1", b"tp1/2|pp0/1"]
    tp2pp2 = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    tags = rank_tags(tp2pp2)
    assert len(tags) == 4 and rank_tag(tp2pp2, 1, 1) in tags
    keys = {object_key(key, tag) for tag in tags + rank_tags(tp2)}
    assert len(keys) == 6 and key not in keys and all(len(k) == 16 for k in keys)
    assert object_key(b"j" * 16, tags[0]) != object_key(key, tags[0])
    check_parallel(tp2pp2)
    with pytest.raises(errors.ConfigError, match="rank tp2/pp0 is outside"):
        rank_tag(tp2, 2)
    for refused in (ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2),
                    ParallelConfig(prefill_context_parallel_size=2)):
        with pytest.raises(errors.ConfigError, match="context parallelism is not supported"):
            check_parallel(refused)


def test_without_a_config_an_engines_pool_saves_into_a_shared_memory_arena_sized_by_dev_shm(monkeypatch) -> None:
    """The connector's pool when ``kv_connector_extra_config`` names no ``config``: no dram
    tier (every save lands in the cxl arena, which same-host engines read in place), no nvme
    tier, and an arena of 2 GiB or a sixteenth of /dev/shm, whichever is less."""
    from kvpool.config import settings_for
    from kvpool.integrations.vllm_settings import default_arena_bytes, default_pool_config

    mib, gib = 1 << 20, 1 << 30
    for shm_bytes, arena in [(1 << 40, 2 * gib), (24 * gib, 1536 * mib), (64 * mib, 4 * mib), (4 * mib, mib)]:
        monkeypatch.setattr(os, "statvfs", lambda path, n=shm_bytes: SimpleNamespace(f_blocks=n // 4096,
                                                                                     f_frsize=4096))
        assert default_arena_bytes() == arena, shm_bytes

    def unreadable(path: str) -> None:
        raise OSError("no /dev/shm")

    monkeypatch.setattr(os, "statvfs", unreadable)
    assert default_arena_bytes() == 2 * gib
    monkeypatch.undo()

    config = settings_for(default_pool_config(), process="client")  # as kvpool.connect opens it
    assert (config.tiers.dram.capacity, config.tiers.nvme.capacity) == (0, 0)
    assert config.tiers.cxl.capacity == default_arena_bytes() and config.tiers.cxl.path == ""  # under /dev/shm
    assert Settings.from_extra({"master": "tcp://h:1"}).pool_config() == default_pool_config()
