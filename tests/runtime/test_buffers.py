"""runtime/buffers.py: uploads and writes, the buffer pool and its bound, arenas, views."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from torch_wgpu_lora.ops.lora import lora
from torch_wgpu_lora.runtime import Arena, Buffer, Recorder, device_info, get_device, kernel, upload, write
from torch_wgpu_lora.runtime.buffers import pool_for, staging_for

from .helpers import read_back


def test_upload_and_read_round_trip_every_dtype():
    arrays = [np.arange(24, dtype=np.float32).reshape(4, 6) / 7, np.arange(10, dtype=np.uint32) * 400_000_000,
              np.arange(-6, 6, dtype=np.int32), np.linspace(-2, 2, 8).astype(np.float16)]
    outs = [np.zeros_like(a) for a in arrays]
    rec = Recorder()
    for a, out in zip(arrays, outs):
        rec.read(upload(a), out)
    rec.submit()
    for a, out in zip(arrays, outs):
        np.testing.assert_array_equal(out, a)


def test_upload_hands_the_arrays_own_memory_to_wgpu(monkeypatch):
    queue = get_device().queue
    seen = []
    original = type(queue).write_buffer
    monkeypatch.setattr(type(queue), "write_buffer",
                        lambda self, buf, off, data, *a: (seen.append(data), original(self, buf, off, data, *a)))
    t = torch.randn(8, 4)
    upload(t.numpy())
    assert np.shares_memory(seen[0], t.numpy())  # no Python-side copy before wgpu's own


def test_read_fills_a_preallocated_tensor_in_place():
    t = torch.empty(3, 8)
    ptr = t.data_ptr()
    rec = Recorder()
    rec.read(upload(np.full((3, 8), 2.5, np.float32)), t.numpy())
    rec.submit()
    assert t.data_ptr() == ptr and torch.equal(t, torch.full((3, 8), 2.5))


def test_upload_refuses_what_it_cannot_pass_without_a_copy():
    with pytest.raises(TypeError, match="float32, float16, uint32 or int32 arrays, got float64"):
        upload(np.zeros(4))
    with pytest.raises(ValueError, match="C-contiguous"):
        upload(np.zeros((4, 4), np.float32).T)


def test_write_checks_size_and_lands_at_its_offset():
    buf = upload(np.zeros(8, np.float32))
    write(buf, np.array([1, 2], np.float32), offset=8)
    np.testing.assert_array_equal(read_back(buf), [0, 0, 1, 2, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="do not fit"):
        write(buf, np.zeros(8, np.float32), offset=4)


# -- the pool --------------------------------------------------------------------------------------

def test_buffers_return_to_the_pool_and_are_reused():
    pool = pool_for(get_device())
    b = Buffer((1000,))
    serial = b.serial
    before = pool.free_bytes
    del b
    assert pool.free_bytes == before + 4000  # its wgpu buffer went back to the pool
    c = Buffer((999,))  # same size bucket
    assert c.serial == serial and pool.free_bytes == before


@pytest.fixture
def small_pool():
    """The pool emptied and bounded at 64 KiB for the test, the garbage collector off (no buffer of
    an earlier test freed meanwhile); both restored afterwards."""
    device = get_device()
    pool = pool_for(device)
    gc.collect()
    pool.release()
    previous = device.configure(pool_bytes=64 << 10)
    gc.disable()
    try:
        yield pool
    finally:
        gc.enable()
        device.configure(previous)


def test_the_pool_keeps_freed_buffers_up_to_its_bound_and_info_says_what_it_holds(small_pool):
    device = get_device()
    allocated = device.allocated
    for n in range(1000, 40_000, 700):  # 56 sizes in different buckets, 4 to 160 KB: most do not fit the pool
        Buffer((n,))  # freed at once
        assert small_pool.free_bytes <= 64 << 10 and device.pooled == small_pool.free_bytes
    memory = device_info()["memory"]
    assert memory["pooled_bytes"] == small_pool.free_bytes > 0 and memory["pool_bound_bytes"] == 64 << 10
    # what the pool did not keep was destroyed: the runtime holds the pool's buffers and nothing more
    assert device.allocated == allocated + small_pool.free_bytes


def test_a_lowered_bound_holds_from_the_next_buffer_freed(small_pool):
    device = get_device()
    kept = [Buffer((4000,)) for _ in range(3)]  # 3 × 16 KB
    del kept
    assert small_pool.free_bytes == 3 * 16384  # each in the 16 KiB bucket
    device.configure(pool_bytes=20_000)
    Buffer((8000,))  # 32 KB, freed: it does not fit, and the pool trims to its bound
    assert small_pool.free_bytes <= 20_000 and device.pooled == small_pool.free_bytes


def test_the_op_over_many_row_counts_holds_no_more_than_the_bound():
    """Calls with many different N (each a new set of buffer sizes) leave the runtime holding at most
    the pool's bound past what it held before, plus the staging buffers it keeps for readbacks."""
    device = get_device()
    pool = pool_for(device)
    gc.collect()
    pool.release()
    previous = device.configure(pool_bytes=256 << 10)
    gc.disable()  # no buffer of an earlier test freed meanwhile
    try:
        A, B = torch.randn(8, 64), torch.randn(48, 8)
        lora(torch.randn(3, 64), A, B, 0.5)  # compiled, its resident weights uploaded
        staging = staging_for(device)
        allocated = device.allocated - staging.kept_bytes
        for n in range(40, 4000, 97):
            x = torch.randn(n, 64)
            y = lora(x, A, B, 0.5)
            ref = 0.5 * (x.double() @ A.double().T) @ B.double().T
            # float32 kernels against float64, as tests/ops/test_lora.py bounds it
            assert (y.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
        assert pool.free_bytes <= 256 << 10
        assert device.allocated - staging.kept_bytes <= allocated + (256 << 10)
    finally:
        gc.enable()
        device.configure(previous)


def test_a_pooled_buffer_wgpu_released_is_never_handed_out():
    # A reference cycle holding a Buffer runs both finalizers: ours pools the wgpu buffer and
    # wgpu-py's releases it. The pool must not give such a buffer to the next Buffer.
    b = Buffer((1234,))
    gpu = b.gpu
    del b  # pooled
    gpu._release()  # what wgpu-py's own finalizer does in the same collection
    fresh = upload(np.ones(1234, np.float32))
    assert fresh.gpu is not gpu
    assert read_back(fresh).sum() == 1234


# -- arenas and views --------------------------------------------------------------------------------

def test_arena_views_are_aligned_separate_and_kernels_see_only_their_range():
    device = get_device()
    arena = Arena(chunk_bytes=1 << 16)
    a = arena.alloc((5,))
    b = arena.alloc((64,))
    big = arena.alloc((40_000,))  # larger than a chunk: a chunk of its own
    assert a.gpu is b.gpu and big.gpu is not a.gpu
    assert b.offset % device.offset_alignment == 0 and b.offset >= a.binding_size
    x = upload(np.arange(256, dtype=np.float32))
    rec = Recorder()
    rec.clear(b)
    rec.dispatch(kernel("reduce.wgsl", "reduce_partials", WG=64), (1, 1, 1), (x, b), (16, 16, 4, 0, 1.0))
    rec.copy(x, a, nbytes=20)
    out_a, out_b = np.zeros(5, np.float32), np.zeros(64, np.float32)
    rec.read(a, out_a)
    rec.read(b, out_b)
    rec.submit()
    np.testing.assert_array_equal(out_a, np.arange(5))
    np.testing.assert_array_equal(out_b, np.arange(256, dtype=np.float32).reshape(4, 64).sum(0))


def test_arena_chunks_grow_from_a_mebibyte_to_their_bound():
    arena = Arena(chunk_bytes=4 << 20)
    for _ in range(20):
        arena.alloc((100_000,))  # 400 kB each: 2 fit 1 MiB, 5 fit 2 MiB, 10 fit 4 MiB
    assert [c.size for c in arena.chunks] == [1 << 20, 2 << 20, 4 << 20, 4 << 20]
    big = Arena(chunk_bytes=4 << 20)
    big.alloc((600_000,))  # 2.4 MB: a first chunk of its size
    assert [c.size for c in big.chunks] == [2_400_000]
    assert arena.nbytes == sum(c.size for c in arena.chunks)


def test_rows_and_slice_are_views_of_their_range_and_refuse_what_does_not_fit():
    x = upload(np.arange(24, dtype=np.float32).reshape(6, 4))
    middle, tail = x.rows(2, 3), x.slice(17, (3,))
    assert middle.gpu is x.gpu and middle.shape == (3, 4) and middle.offset == x.offset + 2 * 16
    np.testing.assert_array_equal(read_back(middle), np.arange(8, 20).reshape(3, 4))
    np.testing.assert_array_equal(read_back(tail), [17, 18, 19])
    with pytest.raises(ValueError, match="rows 4..7 of a buffer of 6 rows"):
        x.rows(4, 3)
    with pytest.raises(ValueError, match="slice of 4 elements at 21"):
        x.slice(21, (4,))
    with pytest.raises(ValueError, match="binding runs past the end"):
        x.slice(21, (3,))
