"""The warm-up a model's runner does at load on a GPU (one eager step of each kind of attention
and one random draw, so every kernel is compiled before the first request) touches nothing a
request sees. Run here on the CPU in the middle of a batch's decoding, with the batch's KV in the
cache: the tokens after it are the tokens without it, and it takes no block (it writes the null
block only)."""

from __future__ import annotations

from tests.gpu.common import prompts, start, tiny_cpu_worker


def decode(me, warm_up_after: int | None) -> list[list[int]]:
    reqs = start(me, prompts(3, seed=4), 12)
    steps = 0
    while me.has_work:
        me.step(0.0)
        steps += 1
        if steps == warm_up_after:
            free = me.kv.allocator.num_free_blocks
            me.runner.warm_up()
            assert me.kv.allocator.num_free_blocks == free
    return [r.output_token_ids for r in reqs]


def test_warm_up_leaves_the_tokens_and_the_blocks_alone():
    plain, warmed = tiny_cpu_worker("plain"), tiny_cpu_worker("warmed")
    assert decode(warmed, warm_up_after=4) == decode(plain, None)
    for me in (plain, warmed):
        me.check_integrity()
        me.close()


def test_warm_up_runs_every_prefill_backend_the_attention_keeps():
    """An attention factory that keeps several prefill backends (FlashInfer's fa2 for small
    steps and fa3 for large ones) gets the warm-up's fresh prompt and cached-prefix chunk once
    through each, small as they are; the decodes once, through its own choice."""
    me = tiny_cpu_worker("backends")
    own = me.runner.attention
    asked: list[tuple[str | None, bool]] = []

    class Backends:
        prefill_backends = ("fa2", "fa3")

        def __call__(self, kv_caches, md, write_kv=True, prefill_backend=None):
            asked.append((prefill_backend, md.is_decode_only))
            return own(kv_caches, md)  # (the CPU's torch attention writes K/V itself)

    me.runner.attention = Backends()
    free = me.kv.allocator.num_free_blocks
    me.runner.warm_up()
    fresh_and_cached = [("fa2", False), ("fa3", False)] * 2
    assert asked == fresh_and_cached + [(None, True)]
    assert me.kv.allocator.num_free_blocks == free
    me.check_integrity()
    me.close()
