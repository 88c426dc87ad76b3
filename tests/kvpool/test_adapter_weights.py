"""LoRA adapters' weights in the page pool, beside their base's: each adapter a buffer of its
own (owner `<adapter>/weights`) with a host copy of the same layout; evicting one gives its
pages back, activating it maps them and copies its bytes in, and its views (the slot's) keep
their addresses, so the step's tokens get what they got before."""

from __future__ import annotations

import pytest
import torch

from kvpool import CpuBackend, HostCopy, PagePool, WeightBuffer, WeightLayout
from models.loader import empty_model
from models.lora import LoraSlots, read_adapter
from tests.models.lora_cases import Request, Spec, greedy, make_adapters, tiny_pair

PAGE = 16 << 10
CPU = torch.device("cpu")


def pool(pages: int) -> PagePool:
    return PagePool(
        CpuBackend(),
        PAGE,
        (pages + 1) * PAGE,
        reclaim_order=lambda owners, me: [o.name for o in owners],
    )


class Placed:
    """The engine's placement of weights: a WeightBuffer per owner, mapped, and a host copy."""

    def __init__(self, p: PagePool):
        self.pool = p
        self.buffers: dict[str, WeightBuffer] = {}
        self.hosts: dict[str, HostCopy] = {}

    def placer(self, owner: str):
        def place(tensors):
            wb = WeightBuffer(self.pool, owner, WeightLayout.pack(tensors))
            assert wb.map(), f"no pages for {owner}"
            self.buffers[owner] = wb
            return wb.views()

        return place

    def save(self, owner: str) -> None:
        wb = self.buffers[owner]
        self.hosts[owner] = HostCopy(wb.nbytes, CPU)
        self.hosts[owner].save(wb.bytes())

    def close(self) -> None:
        for wb in self.buffers.values():
            wb.check_integrity()
            wb.close()
        for h in self.hosts.values():
            h.close()


@pytest.fixture
def setting(tmp_path):
    """A tiny base whose weights live in a pool, two adapters of it made with peft."""
    hf, plain = tiny_pair()
    p = pool(64)
    placed = Placed(p)
    base = empty_model(plain.config, torch.float32, CPU, placed.placer("tiny/weights"))
    base.load_weights(hf.state_dict().items())
    placed.save("tiny/weights")
    specs = {"sql": Spec(r=4, alpha=8, std=0.2), "chat": Spec(r=8, alpha=8, std=0.2)}
    dirs = make_adapters(hf, specs, tmp_path)
    yield p, placed, base, dirs
    placed.close()
    p.check_integrity()
    assert p.stats().owned == {}


def test_each_adapter_is_an_owner_of_its_own_few_pages(setting):
    p, placed, base, dirs = setting
    adapters = {name: read_adapter(dirs[name], base) for name in ("sql", "chat")}
    weights = {n: a.place(placed.placer(f"{n}/weights")) for n, a in adapters.items()}
    owned = p.stats().owned
    for name, a in adapters.items():
        wb = placed.buffers[f"{name}/weights"]
        assert a.nbytes <= wb.nbytes < a.nbytes + 256 * len(a.weights.layout())
        assert owned[f"{name}/weights"] == wb.num_pages == -(-wb.nbytes // PAGE)
        for (n, host), (_, view) in zip(a.weights.named_tensors(), weights[name].named_tensors()):
            assert torch.equal(host, view) and view.data_ptr() != host.data_ptr(), n
    assert owned["tiny/weights"] > owned["sql/weights"] + owned["chat/weights"]
    assert p.stats().owned_by_kind == {"weights": sum(owned.values())}


def test_evicting_an_adapter_frees_its_pages_and_activating_it_restores_its_tokens(setting):
    p, placed, base, dirs = setting
    slots = LoraSlots(base, num_slots=2)
    for i, name in enumerate(("sql", "chat")):
        slots.assign(i, read_adapter(dirs[name], base).place(placed.placer(f"{name}/weights")))
        placed.save(f"{name}/weights")
    requests = [Request([5, 17, 60, 3], 0), Request([8, 1, 90], 1), Request([33, 2, 71], 0)]
    before, before_logits = greedy(base, slots, requests, 5)

    sql = placed.buffers["sql/weights"]
    addr = slots[0].modules["model.layers.0.self_attn.qkv_proj"].a.data_ptr()
    free = p.num_available
    sql.unmap()  # evicted: its pages are the pool's, the other adapter and the base stay
    assert not sql.mapped and p.pages_of("sql/weights") == 0
    assert p.num_available == free + sql.num_pages
    assert placed.buffers["chat/weights"].mapped and placed.buffers["tiny/weights"].mapped
    other = WeightBuffer(
        p, "x/weights", WeightLayout.pack([("w", (sql.num_pages * PAGE,), torch.uint8)])
    )
    assert other.map()  # another owner takes those very pages and writes over them
    other.bytes().fill_(0x7F)
    other.unmap()
    other.check_integrity()
    other.close()
    chat_alone = greedy(base, slots, [Request([8, 1, 90], 1)], 5)  # while sql is away
    assert chat_alone[0][0] == before[1]

    assert sql.map()  # activated: its pages back, its few bytes copied in
    placed.hosts["sql/weights"].load(sql.bytes())
    assert slots[0].modules["model.layers.0.self_attn.qkv_proj"].a.data_ptr() == addr
    after, after_logits = greedy(base, slots, requests, 5)
    assert after == before
    for a, b in zip(after_logits, before_logits):
        assert torch.equal(a, b)
    p.check_integrity()
