"""A step's host tensors reach the device intact through the packed pinned copy, also when the
host packs many more while the device is still busy: no pinned buffer is written again before
the copy that reads it has run."""

from __future__ import annotations

import torch

from models.attention.upload import tensor_on, upload
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
