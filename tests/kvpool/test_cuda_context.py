"""Which context the CUDA backend's driver calls run under, on any thread: its own device's for
the call, and the calling thread's own again after (the runtime's current device is the thread's
current context, so a context left behind would move the thread's torch device: an engine thread
mapping a split model's pages in another device's pool would then step its own models on the
wrong GPU). The driver is a stand-in that keeps a current context per thread: the real one
needs a GPU (the GPU tests map pages through it)."""

from __future__ import annotations

import threading
import types

from kvpool.backend import Reservation
from kvpool.cuda_backend import CudaBackend
from kvpool.page_pool import PagePool

_tls = threading.local()


def _driver(log: list) -> types.SimpleNamespace:
    def current():
        return getattr(_tls, "ctx", 0)

    def call(name):
        def fn(*args):
            log.append((name, current()))
            return (0,)

        return fn

    def set_current(ctx):
        _tls.ctx = ctx
        return (0,)

    handles = iter(range(1, 1000))

    def create(size, prop, flags):
        log.append(("create", current()))
        return (0, next(handles))

    return types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=0),
        cuMemCreate=create,
        cuMemRelease=call("release"),
        cuCtxGetCurrent=lambda: (0, current()),
        cuCtxSetCurrent=set_current,
        cuMemMap=call("map"),
        cuMemSetAccess=call("access"),
        cuMemUnmap=call("unmap"),
    )


def _backend(cu, ctx: int) -> CudaBackend:
    b = object.__new__(CudaBackend)
    b.cu, b._ctx, b._ctx_id = cu, ctx, ctx
    b._prop, b._access, b._granularity = None, [], 2 << 20
    return b


def test_a_call_runs_under_its_devices_context_and_leaves_the_threads_own_current():
    log: list = []
    cu = _driver(log)
    gpu0, gpu1 = _backend(cu, 10), _backend(cu, 11)
    pool0, pool1 = PagePool(gpu0, 2 << 20, 8 << 20), PagePool(gpu1, 2 << 20, 8 << 20)
    res = Reservation(addr=1 << 40, size=8 << 20)
    seen = {}

    def engine_thread_of_gpu0():
        _tls.ctx = 10  # its device set once, as a device worker does
        pool0.register("a")
        pool1.register("split")
        (own,) = pool0.acquire("a", 1)
        gpu0.map(res, 0, own)
        shard = pool1.acquire("split", 2)  # a split model's shard pages, in the other pool
        gpu1.map_many(res, [(2 << 20, shard[0]), (4 << 20, shard[1])])
        gpu1.unmap(res, 2 << 20, 4 << 20)
        pool1.release("split", shard)
        pool0.release("a", [own])
        seen["engine"] = _tls.ctx

    def fresh_thread():  # never touched CUDA: no context
        gpu1.unmap(res, 0, 2 << 20)
        seen["fresh"] = getattr(_tls, "ctx", 0)

    for target in (engine_thread_of_gpu0, fresh_thread):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    calls = [c for c in log if c[0] != "create"]
    assert calls == [
        ("map", 10),
        ("access", 10),
        ("map", 11),
        ("map", 11),
        ("access", 11),  # one set-access for the run of two adjacent pages
        ("unmap", 11),
        ("unmap", 11),
    ]
    assert {ctx for name, ctx in log if name == "create"} == {10, 11}  # each under its own
    assert getattr(_tls, "ctx", 0) == 0  # the pools made here left this thread as it was
    assert seen == {"engine": 10, "fresh": 0}
    for pool in (pool0, pool1):
        pool.check_integrity()
