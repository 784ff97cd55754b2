"""Pools and batches sized to the device: the rule on made-up memory figures (no GPU
needed), the shares `pdmesh up` hands out, and the start-up refusals that name a flag."""

from __future__ import annotations

import pytest
import torch

from libs.member import kv_member, sizing
from libs.member.sizing import GIB, DeviceMemory, kv_pages_that_fit
from pdmesh.supervisor import Plan

SMOLLM2_BF16_PAGE = 30 * 2 * 3 * 16 * 64 * 2  # bytes of one 16-token page (360 KiB)
WEIGHTS = int(0.27 * GIB)
CONTEXT = int(0.5 * GIB)  # a CUDA context: outside torch's count


def card(total_gib: float = 80.0) -> DeviceMemory:
    total = int(total_gib * GIB)
    return DeviceMemory(free=total - CONTEXT - WEIGHTS, total=total, used_here=WEIGHTS)


def test_a_member_fills_its_share_less_its_weights_and_the_reserve():
    pages = kv_pages_that_fit(card(), 0.425, SMOLLM2_BF16_PAGE, max_pages=10**9)
    expected = (int(0.425 * 80 * GIB) - WEIGHTS - sizing.RESERVE_BYTES) // SMOLLM2_BF16_PAGE
    assert pages == expected
    # 128 requests of 200-word prompts and 128 new tokens (about 25 pages each) fit many times
    assert pages > 128 * 25 * 10


def test_a_prefill_and_a_decode_on_one_card_stay_within_the_mesh_fraction():
    total = 80 * GIB
    free = total - 2 * CONTEXT - 2 * WEIGHTS  # both loaded their weights
    used = []
    for _ in range(2):  # one sizes its pool, allocates it, then the other sizes its own
        pages = kv_pages_that_fit(DeviceMemory(free, total, WEIGHTS), 0.85 / 2,
                                  SMOLLM2_BF16_PAGE, max_pages=10**9)
        free -= pages * SMOLLM2_BF16_PAGE
        used.append(WEIGHTS + pages * SMOLLM2_BF16_PAGE)
    assert used[0] == used[1]  # the share binds, not what the first one left free
    assert sum(used) <= 0.85 * total
    assert free >= 0.15 * total - 2 * CONTEXT  # activations and contexts still have room


def test_a_share_larger_than_what_is_free_takes_what_is_free_less_the_reserve():
    memory = DeviceMemory(free=10 * GIB, total=80 * GIB, used_here=WEIGHTS)
    pages = kv_pages_that_fit(memory, 0.85, SMOLLM2_BF16_PAGE, max_pages=10**9)
    assert pages * SMOLLM2_BF16_PAGE <= 10 * GIB - 2 * sizing.RESERVE_BYTES
    assert pages == (10 * GIB - 2 * sizing.RESERVE_BYTES) // SMOLLM2_BF16_PAGE


def test_pages_no_room_could_use_are_not_taken_and_nothing_is_never_negative():
    assert kv_pages_that_fit(card(), 0.85, 8192, max_pages=32_768) == 32_768
    full = DeviceMemory(free=GIB // 2, total=80 * GIB, used_here=WEIGHTS)
    assert kv_pages_that_fit(full, 0.85, SMOLLM2_BF16_PAGE, max_pages=10**9) == 0
    with pytest.raises(ValueError, match="fraction"):
        kv_pages_that_fit(card(), 0.0, SMOLLM2_BF16_PAGE, max_pages=1)


def test_batch_and_pool_defaults_on_the_cpu_are_the_fixed_ones():
    assert sizing.default_max_batch("cpu") == 64
    assert sizing.default_max_batch("cuda") == sizing.default_max_batch("cuda:1") == 256
    assert sizing.CPU_KV_PAGES == {"prefill": 512, "decode": 2048}


def fractions(plan: Plan) -> list[str]:
    """The --gpu-memory-fraction each child of `plan` is given, in start order."""
    out = []
    for child in plan.children():
        if "--gpu-memory-fraction" in child.argv:
            out.append(child.argv[child.argv.index("--gpu-memory-fraction") + 1])
    return out


def devices(plan: Plan) -> dict[str, str]:
    return {c.name: c.argv[c.argv.index("--device") + 1]
            for c in plan.children() if "--device" in c.argv}


def test_up_gives_each_member_on_a_gpu_its_share_and_the_cpu_nothing_new():
    assert fractions(Plan(device="cuda")) == ["0.425", "0.425"]
    assert fractions(Plan(device="cuda:1", prefill=2, decode=2, gpu_memory_fraction=0.8)) == \
        ["0.2"] * 4
    assert fractions(Plan(device="cpu")) == []


def test_prefill_and_decode_on_their_own_gpus_each_get_the_whole_fraction_of_theirs():
    two = Plan(device="cuda", prefill_device="cuda:0", decode_device="cuda:1")
    assert devices(two) == {"prefill-0": "cuda:0", "decode-0": "cuda:1"}
    assert fractions(two) == ["0.85", "0.85"]
    assert two.describe_devices() == ("prefill on cuda:0 (0.85 of its memory each), "
                                      "decode on cuda:1 (0.85 of its memory each)")
    # "cuda" is cuda:0: a prefill there and a decode on cuda:0 share one GPU
    shared = Plan(device="cuda", decode_device="cuda:0", prefill=1, decode=3)
    assert devices(shared)["prefill-0"] == "cuda" and fractions(shared) == ["0.2125"] * 4
    # two prefills on one GPU, a decode alone on the other
    mixed = Plan(device="cuda:1", decode_device="cuda:0", prefill=2, decode=1)
    assert fractions(mixed) == ["0.425", "0.425", "0.85"]
    assert devices(Plan(device="cpu", decode_device="cpu")) == \
        {"prefill-0": "cpu", "decode-0": "cpu"}
    assert Plan(device="cuda:1").describe_devices() == "on cuda:1 (0.425 of its memory each)"


def test_device_check_names_what_is_wrong():
    assert sizing.check_device("cpu") is None
    assert "is not a device" in sizing.check_device("tpu")
    assert "is not a device" in sizing.check_device("cuda:x")
    if not torch.cuda.is_available():
        assert "no CUDA device" in sizing.check_device("cuda")
    else:
        assert "does not exist" in sizing.check_device(f"cuda:{torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def tiny():
    from libs.engine.loader import load_model

    return load_model("random:tiny")


def test_a_gpu_too_full_for_one_request_is_refused_naming_the_flags(tiny, monkeypatch):
    page = kv_member.bytes_per_page(tiny, 16, "native")
    free = 2 * sizing.RESERVE_BYTES + 10 * page  # ten pages: less than a 2048-token request
    monkeypatch.setattr(sizing, "device_memory",
                        lambda device: DeviceMemory(free, 80 * GIB, 0))
    with pytest.raises(kv_member.DoesNotFit) as e:
        kv_member.pool_pages("decode", tiny, "cuda", 16, "native", 0.5, 256)
    message = str(e.value)
    assert "room for only 10 KV pages" in message
    assert "--kv-pages" in message and "--decode-kv-pages" in message
    assert "--gpu-memory-fraction" in message


def test_a_gpu_pool_is_capped_at_what_the_rooms_can_use(tiny, monkeypatch):
    monkeypatch.setattr(sizing, "device_memory",
                        lambda device: DeviceMemory(79 * GIB, 80 * GIB, 0))
    pages = kv_member.pool_pages("prefill", tiny, "cuda", 16, "native", 0.85, max_rooms=4)
    assert pages == 4 * 2048 // 16
    assert kv_member.pool_pages("prefill", tiny, "cpu", 16, "native", None, 4) == 512


def test_nvfp4_staging_slots_count_in_a_page_cost(tiny):
    native = kv_member.bytes_per_page(tiny, 16, "native")
    assert native == 2 * 2 * 2 * 16 * 16 * 4
    assert native < kv_member.bytes_per_page(tiny, 16, "nvfp4") < 1.5 * native


def test_running_out_of_cuda_memory_at_start_names_the_stage_and_the_flags():
    with pytest.raises(kv_member.DoesNotFit) as e:
        with kv_member.out_of_memory_at_start("prefill", "cpu", "allocating the KV pool"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
    message = str(e.value)
    assert message.startswith("CUDA out of memory on cpu allocating the KV pool.")
    assert "--kv-pages" in message and "--prefill-kv-pages" in message
    assert "--gpu-memory-fraction" in message


def test_overlapped_decode_steps_default_to_cuda_only():
    from services.decode.main import overlap_steps

    assert overlap_steps("auto", "cuda") and overlap_steps("auto", "cuda:1")
    assert not overlap_steps("auto", "cpu")
    assert overlap_steps("on", "cpu") and not overlap_steps("off", "cuda")
