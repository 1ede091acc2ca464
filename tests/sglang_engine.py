"""An SGLang "engine" for tests/integrations/test_sglang.py: SGLang's own host pools, storage config and
backend factory around kvpool's HiCache backend, without a model (SGLang's engine does not
run on this CPU: its CPU path needs sgl_kernel ops built for AVX-512).

Imported by the tests, and run as the other engine's process::

    python -m tests.sglang_engine read SPEC_JSON

builds each case's host pool and backend, asks ``batch_exists`` and ``batch_get_v1`` for its
pages and prints one JSON line: per case the pages found and each page's digest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

EXTRA = {"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
         "class_name": "KvpoolHiCacheStorage", "interface_v1": 1}
PAGE_SIZE = 4  # tokens a page
LAYERS = 3


def load_sglang() -> None:
    """Import what the tests use of SGLang; ImportError where it is not installed.

    SGLang imports torchvision at import time (its InternVL image code, via its model
    configs). PyPI's torchvision is a CUDA build whose C ops do not load beside a CPU torch,
    and its import then fails on two fake-kernel registrations that are not guarded
    (``torchvision::nms``, ``::qnms``). Where its ops cannot load, those two ops' schemas are
    declared first so that its Python part imports; its ops stay absent, and nothing here
    uses them. With a torch its ops load beside (CUDA), nothing is declared."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("No module named 'sglang'")
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is not None and spec.origin is not None and "torchvision" not in sys.modules:
        try:
            torch.ops.load_library(os.path.join(os.path.dirname(spec.origin), "_C.so"))
        except OSError:
            fragment = torch.library.Library("torchvision", "FRAGMENT")
            fragment.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            fragment.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _KEEP.append(fragment)
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
    import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
    import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401


_KEEP: list[Any] = []  # a torch.library fragment is undone when collected


def host_pool(kind: str, layout: str, *, page_size: int = PAGE_SIZE, layers: int = LAYERS, dtype: str = "bfloat16",
              tokens: int = 256) -> Any:
    """SGLang's own host pool (MHATokenToKVPoolHost / MLATokenToKVPoolHost) on the CPU, over a
    CPU device pool of ``tokens`` tokens (pin_memory=False: pinning needs CUDA)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    torch_dtype = getattr(torch, dtype)
    if kind == "mha":
        device = MHATokenToKVPool(tokens, page_size, torch_dtype, 2, 8, layers, "cpu", False,
                                  start_layer=0, end_layer=layers)
        return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                    pin_memory=False, device_capacity_tokens=device.size,
                                    start_layer=device.start_layer, end_layer=device.end_layer)
    device = MLATokenToKVPool(tokens, page_size, torch_dtype, 16, 8, layers, "cpu", False,
                              start_layer=0, end_layer=layers)
    return MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                pin_memory=False, device_capacity_tokens=device.size,
                                start_layer=device.start_layer, end_layer=device.end_layer, target_layer_num=layers)


def storage_config(kind: str, extra: dict[str, Any], *, model: str = "org/test-model", tp_rank: int = 0,
                   tp_size: int = 1, layout: str = "page_first") -> Any:
    """SGLang's HiCacheStorageConfig, as its cache controller makes it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=kind == "mla", enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config={**EXTRA, **extra})


def attach(host: Any, kind: str, extra: dict[str, Any], **config: Any) -> Any:
    """The backend as SGLang's cache controller attaches it: the factory's ``dynamic`` backend
    (``cls(storage_config, kwargs)``), then the host pool through ``register_mem_pool_host``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(kind, extra, layout=host.layout,
                                                                                  **config), host)
    backend.register_mem_pool_host(host)
    return backend


def indices(host: Any, slots: Sequence[int]) -> Any:
    """Host indices of the pages in host page slots ``slots`` (page_size indices each)."""
    import torch

    return torch.cat([torch.arange(s * host.page_size, (s + 1) * host.page_size) for s in slots]).to(torch.int64)


def _arena(host: Any) -> np.ndarray:
    import torch

    return host.kv_buffer.view(torch.uint8).reshape(-1).numpy()


def _pieces(host: Any, slot: int) -> list[np.ndarray]:
    """Page slot ``slot``'s pieces (SGLang's get_page_buffer_meta) as byte views of the host pool."""
    ptrs, sizes = host.get_page_buffer_meta(indices(host, [slot]))
    arena, base = _arena(host), host.kv_buffer.data_ptr()
    return [arena[p - base:p - base + n] for p, n in zip(ptrs, sizes)]


def fill(host: Any, slots: Sequence[int], seed: int) -> None:
    """Random bytes in every piece of the pages in ``slots``."""
    rng = np.random.default_rng(seed)
    for slot in slots:
        for piece in _pieces(host, slot):
            piece[:] = rng.integers(0, 256, len(piece), dtype=np.uint8)


def digest(host: Any, slot: int) -> str:
    """The page in ``slot``: xxh3-128 of its pieces' bytes, in SGLang's order."""
    hasher = xxhash.xxh3_128()
    for piece in _pieces(host, slot):
        hasher.update(piece.tobytes())
    return hasher.hexdigest()


def page_bytes(host: Any, slot: int) -> bytes:
    return b"".join(piece.tobytes() for piece in _pieces(host, slot))


def read(spec: dict[str, Any]) -> dict[str, Any]:
    """Each case of ``spec``: its backend's ``batch_exists`` of its keys and ``batch_get_v1``
    into slots after the first (other slots than the writer's), with each page's digest."""
    results: dict[str, Any] = {}
    for case in spec["cases"]:
        host = host_pool(case["kind"], case["layout"])
        backend = attach(host, case["kind"], {"master": spec["master"], "config": case["pool"]},
                         model=case.get("model", "org/test-model"), tp_rank=case.get("tp_rank", 0),
                         tp_size=case.get("tp_size", 1))
        try:
            keys = case["keys"]
            slots = [10 + i for i in range(len(keys))]
            found = backend.batch_exists(keys)
            got = backend.batch_get_v1(keys, indices(host, slots))
            results[case["name"]] = {"exists": found, "got": got,
                                     "digests": [digest(host, s) if ok else None for s, ok in zip(slots, got)]}
        finally:
            backend.close()
    return results


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != "read":
        print("usage: python -m tests.sglang_engine read SPEC_JSON", file=sys.stderr)
        return 2
    load_sglang()
    print("RESULT " + json.dumps(read(json.loads(argv[1]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
