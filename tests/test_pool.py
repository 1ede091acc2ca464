from __future__ import annotations

import random
import re
import threading

import numpy as np
import pytest

import kvpool
from kvpool import errors
from tests.pool_configs import MiB, small_config

SHAPE = (8, 2, 32, 4, 64)  # 8 layers of 32 KiB (float16): 256 KiB + header


def kv(seed: int, shape: tuple[int, ...] = SHAPE, dtype: str = "float16") -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.fixture(params=[("dram",), ("hbm", "dram", "cxl", "nvme")], ids=["dram", "all-tiers"])
def pool(request, tmp_path):
    pool = kvpool.Pool(small_config(tmp_path, request.param))
    yield pool
    pool.close()


def test_put_get_whole_and_layers(pool: kvpool.Pool) -> None:
    arr = kv(1)
    pool.put(b"h" * 16, arr)
    np.testing.assert_array_equal(pool.get(b"h" * 16), arr)
    np.testing.assert_array_equal(pool.get(b"h" * 16, layers=range(2, 5)), arr[2:5])
    np.testing.assert_array_equal(pool.get(b"h" * 16, layers=7), arr[7:8])
    assert pool.get(b"x" * 16) is None


def test_get_fills_out_in_place(pool: kvpool.Pool) -> None:
    arr = kv(2)
    pool.put(b"k", arr)
    out = np.zeros((3,) + SHAPE[1:], dtype=np.float16)
    result = pool.get(b"k", layers=range(4, 7), out=out)
    assert result is out
    np.testing.assert_array_equal(out, arr[4:7])
    raw = bytearray(arr[0:1].nbytes)
    view = pool.get(b"k", layers=0, out=raw)
    assert bytes(raw) == arr[0:1].tobytes() and view.shape == (1,) + SHAPE[1:]


def test_bad_out_buffers_are_typed_errors(pool: kvpool.Pool) -> None:
    pool.put(b"k", kv(3))
    for bad in (np.zeros((2,) + SHAPE[1:], np.float16), np.zeros(SHAPE, np.float32),
                np.zeros(SHAPE, np.float16)[:, :, ::2], bytearray(10), bytes(kv(3).nbytes), object()):
        with pytest.raises(errors.OutBufferError):
            pool.get(b"k", out=bad)
    with pytest.raises(errors.LayerRangeError):
        pool.get(b"k", layers=range(6, 9))


def test_bad_input_is_refused_and_loses_nothing(pool: kvpool.Pool) -> None:
    pool.put(b"keep", kv(4))
    with pytest.raises(errors.ShapeError):
        pool.put(b"keep", np.zeros((8, 2, 32, 4), np.float16))
    with pytest.raises(errors.ShapeError):
        pool.put(b"keep", np.zeros((8, 3, 32, 4, 64), np.float16))
    with pytest.raises(errors.DTypeError):
        pool.put(b"keep", np.zeros(SHAPE, np.int64))
    with pytest.raises(errors.InvalidKeyError):
        pool.put(b"", kv(4))
    with pytest.raises(errors.InvalidKeyError):
        pool.put(12345, kv(4))  # type: ignore[arg-type]
    with pytest.raises(errors.ObjectTooLargeError) as too_large:
        pool.put(b"keep", np.zeros((64, 2, 256, 8, 128), np.float16))  # 64 MiB > every tier
    # The message gives each tier's real limit (its capacity less the per-object overhead), and
    # an object of exactly that size does fit.
    limits = dict(re.findall(r"(\w+) up to (\d+) bytes", str(too_large.value)))
    manager = pool.manager
    assert set(limits) == {t.name for t, put in zip(manager.tiers, manager.put_enabled) if put}
    for tier in pool.manager.tiers:
        if tier.name in limits:
            assert tier.fits_ever(int(limits[tier.name])) and not tier.fits_ever(int(limits[tier.name]) + 1)
    np.testing.assert_array_equal(pool.get(b"keep"), kv(4))


def test_delete_exists_and_unknown_key(pool: kvpool.Pool) -> None:
    pool.put("text-key", kv(5))
    assert pool.exists("text-key") and pool.exists(b"text-key")
    pool.delete("text-key")
    assert not pool.exists("text-key") and pool.get("text-key") is None
    with pytest.raises(errors.KeyNotFoundError):
        pool.delete("text-key")


def test_lookup_finds_longest_cached_prefix(pool: kvpool.Pool) -> None:
    hashes = kvpool.prefix_hashes(list(range(256 * 5)), 256)
    for h in hashes[:3]:
        pool.put(h, kv(6, (2, 2, 4, 2, 8)))
    assert pool.lookup(hashes) == 3
    pool.delete(hashes[1])
    assert pool.lookup(hashes) == 1
    assert pool.lookup([]) == 0
    assert pool.exists_many(hashes) == [True, False, True, False, False]


def test_batches(pool: kvpool.Pool) -> None:
    items = {b"b%d" % i: kv(i) for i in range(4)}
    pool.put_many(items)
    got = pool.get_many([b"b0", b"nope", b"b3"], layers=range(0, 2))
    np.testing.assert_array_equal(got[0], items[b"b0"][:2])
    assert got[1] is None
    np.testing.assert_array_equal(got[2], items[b"b3"][:2])
    outs = [np.empty((2,) + SHAPE[1:], np.float16) for _ in range(2)]
    filled = pool.get_many([b"b1", b"b2"], layers=range(0, 2), outs=outs)
    assert filled[0] is outs[0] and filled[1] is outs[1]
    np.testing.assert_array_equal(outs[1], items[b"b2"][:2])
    with pytest.raises(errors.OutBufferError):
        pool.get_many([b"b1", b"b2"], outs=outs[:1])
    # One layer range per key (a key once per range), each result told as it comes.
    told: list[tuple[int, np.ndarray | None]] = []
    each = pool.get_many([b"b1", b"b1", b"nope"], layers=[range(0, 1), (2, 4), 0],
                         landed=lambda i, arr: told.append((i, arr)))
    np.testing.assert_array_equal(each[0], items[b"b1"][:1])
    np.testing.assert_array_equal(each[1], items[b"b1"][2:4])
    assert each[2] is None and [i for i, _ in told] == [0, 1, 2] and all(a is b for (_, a), b in zip(told, each))
    with pytest.raises(errors.LayerRangeError):
        pool.get_many([b"b1", b"b2"], layers=[range(0, 1)])
    with pytest.raises(errors.ShapeError):
        pool.put_many([(b"ok", kv(9)), (b"bad", np.zeros(3))])
    assert not pool.exists(b"ok")  # validated before anything was stored


def test_bfloat16_and_fp8_as_raw_types(pool: kvpool.Pool) -> None:
    raw16 = np.random.default_rng(1).integers(0, 2**16, SHAPE, dtype=np.uint16)
    pool.put(b"bf16", raw16, dtype="bfloat16")
    out = pool.get(b"bf16")
    assert out.dtype.itemsize == 2 and out.view(np.uint16).tobytes() == raw16.tobytes()
    raw8 = np.random.default_rng(2).integers(0, 255, SHAPE, dtype=np.uint8)
    pool.put(b"fp8", raw8, dtype="float8_e4m3fn")
    assert pool.get(b"fp8", layers=range(1, 3)).view(np.uint8).tobytes() == raw8[1:3].tobytes()


def test_dlpack_torch_tensor(pool: kvpool.Pool) -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.randn(SHAPE, dtype=torch.float16)
    pool.put(b"torch", tensor)
    np.testing.assert_array_equal(pool.get(b"torch"), tensor.numpy())
    bf16 = torch.randn(SHAPE, dtype=torch.bfloat16)
    pool.put(b"torch-bf16", bf16)
    assert pool.get(b"torch-bf16").view(np.uint16).tobytes() == bf16.view(torch.int16).numpy().tobytes()


def test_a_tensor_that_requires_grad_is_stored_without_its_graph(pool: kvpool.Pool) -> None:
    torch = pytest.importorskip("torch")
    leaf = torch.randn(SHAPE, dtype=torch.float32, requires_grad=True)
    produced = leaf * 2  # what a forward pass run with autograd on hands out
    pool.put(b"grad", produced)
    np.testing.assert_array_equal(pool.get(b"grad"), produced.detach().numpy())


def test_non_contiguous_input_is_stored_correctly(pool: kvpool.Pool) -> None:
    base = kv(7, (8, 2, 32, 4, 128))
    arr = base[..., ::2]
    pool.put(b"strided", arr)
    np.testing.assert_array_equal(pool.get(b"strided"), arr)


async def test_async_twins_and_iter_layers(pool: kvpool.Pool) -> None:
    arr = kv(8)
    await pool.aput(b"a", arr)
    np.testing.assert_array_equal(await pool.aget(b"a", layers=range(1, 2)), arr[1:2])
    assert await pool.aexists(b"a")
    seen = []
    async for layer, layer_arr in pool.iter_layers(b"a", layers=range(2, 6)):
        np.testing.assert_array_equal(layer_arr, arr[layer])
        seen.append(layer)
    assert seen == [2, 3, 4, 5]
    assert [x async for x in pool.iter_layers(b"missing")] == []


def test_iter_layers_works_with_a_plain_for(pool: kvpool.Pool) -> None:
    arr = kv(9)
    pool.put(b"s", arr)
    seen = [(layer, layer_arr.copy()) for layer, layer_arr in pool.iter_layers(b"s", layers=range(1, 4))]
    assert [layer for layer, _ in seen] == [1, 2, 3]
    for layer, layer_arr in seen:
        np.testing.assert_array_equal(layer_arr, arr[layer])
    out = np.empty((8,) + SHAPE[1:], np.float16)
    for layer, layer_arr in pool.iter_layers(b"s", out=out):
        assert np.shares_memory(layer_arr, out)
        if layer == 2:
            break  # leaving early releases the object: it can be deleted at once
    pool.delete(b"s")
    assert list(pool.iter_layers(b"missing")) == []
    pool.put(b"s2", arr)
    with pytest.raises(errors.LayerRangeError):
        list(pool.iter_layers(b"s2", layers=range(9, 20)))
    pool.delete(b"s2")  # the failed iteration pinned nothing


def test_a_wrong_out_dtype_is_a_dtype_error_and_an_out_buffer_error(pool: kvpool.Pool) -> None:
    pool.put(b"d", kv(10))
    out = np.empty(SHAPE, np.float32)
    with pytest.raises(errors.DTypeError) as caught:
        pool.get(b"d", out=out)
    assert isinstance(caught.value, errors.OutBufferError)
    with pytest.raises(errors.OutBufferError) as wrong_shape:
        pool.get(b"d", out=np.empty((1,) + SHAPE[1:], np.float16))
    assert not isinstance(wrong_shape.value, errors.DTypeError)  # a wrong size is not a dtype matter


def test_a_second_pool_of_the_same_settings_in_one_process_says_it_is_this_process(tmp_path) -> None:
    config = small_config(tmp_path, ("dram", "cxl", "nvme"))
    with kvpool.Pool(config):
        with pytest.raises(errors.PoolLockedError, match="already open in this process") as caught:
            kvpool.Pool(config)
        assert "another process" not in str(caught.value)
    with kvpool.Pool(config):  # closed, it opens again
        pass


def test_closed_pool_refuses_every_call(tmp_path) -> None:
    pool = kvpool.Pool(small_config(tmp_path, ("dram",)))
    pool.put(b"k", kv(1))
    pool.close()
    pool.close()  # idempotent
    for call in (lambda: pool.get(b"k"), lambda: pool.put(b"k", kv(1)), lambda: pool.exists(b"k"),
                 lambda: pool.delete(b"k"), lambda: pool.stats()):
        with pytest.raises(errors.PoolClosedError):
            call()


def test_a_second_process_opening_the_same_pool_is_told_what_to_do(tmp_path) -> None:
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    config = small_config(tmp_path, ("dram", "cxl", "nvme"))
    pool = kvpool.Pool(config)
    try:
        pool.put(b"mine", kv(1))
        code = ("import sys, kvpool; from tests.pool_configs import small_config; from pathlib import Path; "
                "kvpool.Pool(small_config(Path(sys.argv[1]), ('dram', 'cxl', 'nvme')))")
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              timeout=60, cwd=REPO_ROOT)
        assert done.returncode != 0
        assert "PoolLockedError" in done.stderr and "kvpool.connect" in done.stderr, done.stderr[-2000:]
        np.testing.assert_array_equal(pool.get(b"mine"), kv(1))  # the owner lost nothing
    finally:
        pool.close()


def test_stats_report_tiers_hits_and_misses(pool: kvpool.Pool) -> None:
    pool.put(b"k", kv(1))
    pool.get(b"k")
    pool.get(b"absent")
    stats = pool.stats()
    assert stats["objects"] == 1 and stats["hits"] == 1 and stats["misses"]["absent"] == 1
    assert stats["counters"]["bytes_put"] == kv(1).nbytes
    assert "dram" in stats["tiers"]
    for tier in stats["tiers"].values():
        assert tier["used_bytes"] <= tier["capacity_bytes"]


def test_eight_threads_hammering_one_pool_see_only_exact_content(tmp_path) -> None:
    pool = kvpool.Pool(small_config(tmp_path, ("hbm", "dram", "cxl", "nvme"), dram=1 * MiB, cxl=2 * MiB))
    shape = (4, 2, 16, 4, 64)  # 32 KiB objects: tiers overflow, demotions and evictions happen
    expected = {b"t%d-%d" % (t, i): kv(t * 100 + i, shape) for t in range(8) for i in range(40)}
    failures: list[BaseException] = []

    def worker(t: int) -> None:
        rnd = random.Random(t)
        try:
            mine = [k for k in expected if k.startswith(b"t%d-" % t)]
            for _ in range(300):
                key = rnd.choice(mine)
                op = rnd.random()
                if op < 0.4:
                    pool.put(key, expected[key])
                elif op < 0.8:
                    got = pool.get(key, layers=range(rnd.randrange(4), 4))
                    if got is not None:
                        np.testing.assert_array_equal(got, expected[key][4 - got.shape[0]:])
                elif op < 0.9:
                    try:
                        pool.delete(key)
                    except errors.KeyNotFoundError:
                        pass
                else:
                    pool.lookup(mine[:5])
        except BaseException as exc:  # reported to the main thread below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    try:
        assert not failures, failures[0]
        stats = pool.stats()
        for tier in stats["tiers"].values():
            assert tier["used_bytes"] <= tier["capacity_bytes"]
        for key in expected:
            got = pool.get(key)
            if got is not None:
                np.testing.assert_array_equal(got, expected[key])
    finally:
        pool.close()
