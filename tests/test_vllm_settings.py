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
        from kvpool.integrations.vllm_settings import _sampled_ranges

        ranges = _sampled_ranges(fh.fileno(), size, True)
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
    # How the weights are read is part of the model: quantization at load, config overrides.
    assert ns(model, quantization="fp8") != ns(model)
    assert ns(model, hf_overrides={"rope_theta": 1e6}) != ns(model)
    assert Settings.from_extra(named).model_id == "llama-3-8b-instruct@v2"
    assert Settings.from_extra({"master": "tcp://h:1"}).model_id is None
    for bad in ("", "  ", 7):
        with pytest.raises(errors.ConfigError, match='"model_id"'):
            Settings.from_extra({"master": "tcp://h:1", "model_id": bad})
