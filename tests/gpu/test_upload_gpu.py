"""A step's host tensors reach the device intact through the packed pinned copy, also when the
host packs many more while the device is still busy: no pinned buffer is written again before
the copy that reads it has run."""

from __future__ import annotations

import torch

from models.attention.flashinfer_paged import PagedKVIndex
from models.attention.upload import pinned, tensor_on, upload
from tests.gpu.common import GPU

pytestmark = GPU


def test_many_uploads_queued_behind_a_busy_device_all_arrive_intact():
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(40):  # ~90 ms of fp32 matmuls: the copies below queue behind them
        a @ a
    sent, got = [], []
    for i in range(300):
        n = int(torch.randint(0, 700, (1,), generator=gen))
        host = [
            torch.randint(-(2**40), 2**40, (n,), generator=gen),  # int64
            torch.randint(0, 2**31 - 1, (i % 5 + 1, 3), generator=gen, dtype=torch.int32),
            torch.randint(0, 2**31 - 1, (n % 7,), generator=gen).to(torch.int32),
        ]
        sent.append(host)
        got.append(upload(host, dev))
    for host, out in zip(sent, got):
        for h, o in zip(host, out):
            assert o.device.type == "cuda" and o.dtype == h.dtype and o.shape == h.shape
            assert torch.equal(o.cpu(), h)
    assert tensor_on([3, 1, 2], torch.int32, dev).tolist() == [3, 1, 2]
    assert upload([], dev) == []


def test_an_index_in_pinned_memory_reaches_the_device_intact_behind_a_busy_device():
    """FlashInfer's plan copies the index arrays itself: from pinned views, asynchronously.
    Many indices pinned and copied while the device is busy each arrive as they were."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(40):
        a @ a
    sent, got = [], []
    for i in range(200):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        ix = PagedKVIndex(
            torch.arange(i % 7 + 2, dtype=torch.int32),
            torch.arange(i % 5 + 2, dtype=torch.int32) * 3,
            torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int32),
            torch.randint(1, 17, (i % 5 + 1,), generator=gen, dtype=torch.int32),
        )
        p = ix.pinned(dev)
        assert all(t.is_pinned() for t in vars(p).values())
        sent.append(ix)
        got.append([t.to(dev, non_blocking=True) for t in vars(p).values()])
    for ix, out in zip(sent, got):
        for h, o in zip(vars(ix).values(), out):
            assert torch.equal(o.cpu(), h)
    assert pinned([], dev) == []
