"""kernels/occupancy.py against NVIDIA's occupancy rules worked by hand, and the split count sized from it.

The cases are the CUDA Occupancy Calculator's arithmetic for compute capability 9.0 (65,536 registers, 64
warps, 228 KiB of shared memory and 32 programs per multiprocessor; registers given to a warp in units of
256; 1 KiB of shared memory reserved per program), each worked out below its line.
"""

from types import SimpleNamespace

import pytest
import torch

from oscar_sglang.kernels import occupancy
from oscar_sglang.kernels.decode import triton_kernel as dec
from oscar_sglang.kernels.occupancy import Multiprocessor, resident_programs


@pytest.mark.parametrize("registers,shared,warps,want", [
    # 255 -> 256 per thread, 8192 per warp: 8 warps fit; programs of 4 warps: 2
    (255, 0, 4, 2),
    # the same loop at 2 warps: still 8 warps, so 4 programs
    (255, 10240, 2, 4),
    # 128 per thread: 4096 per warp, 16 warps: 8 programs of 2 warps
    (128, 10240, 2, 8),
    # 220 per thread: 7040 per warp -> 7168 (28 units of 256): 9 warps fit, 2 whole programs of 4
    (220, 73728, 4, 2),
    # 102 per thread: 3264 -> 3328 per warp: 19 warps, 4 programs of 4; shared 43136 + 1024: 5 programs
    (102, 43136, 4, 4),
    # 64 per thread: 2048 per warp: 32 warps by registers, but 64 / 4 warps = 16; shared 73728 + 1024: 3
    (64, 73728, 4, 3),
    # tiny programs: 32 per multiprocessor at most (64 warps would allow 64 of 1 warp)
    (16, 0, 1, 32),
    # more shared memory than a multiprocessor has: none
    (32, 240000, 4, 0),
])
def test_resident_programs_follows_the_occupancy_rules(registers, shared, warps, want):
    assert resident_programs(registers, shared, warps) == want


def test_resident_programs_takes_another_multiprocessor_and_refuses_nonsense():
    a100 = Multiprocessor(shared_bytes=167936)  # sm_80: 164 KiB
    # shared 73728 + 1024 per program: 3 on an H100, 2 on an A100 (registers allow 4 of 4 warps at 96)
    assert resident_programs(96, 73728, 4) == 3 and resident_programs(96, 73728, 4, a100) == 2
    with pytest.raises(ValueError):
        resident_programs(64, 0, 0)


def test_multiprocessor_reads_the_limits_torch_reports(monkeypatch):
    props = SimpleNamespace(regs_per_multiprocessor=32768, max_threads_per_multi_processor=1536,
                            shared_memory_per_multiprocessor=102400, warp_size=32)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    sm = Multiprocessor.of(torch.device("cuda", 0))
    assert (sm.registers, sm.max_warps, sm.shared_bytes) == (32768, 48, 102400)
    # a field torch does not report: the sm_90 default
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(warp_size=32))
    assert Multiprocessor.of(torch.device("cuda", 0)) == Multiprocessor()


@pytest.mark.parametrize("capability,threads,shared,want", [
    # an L4 / L40S (sm_89): 48 warps, 100 KiB (+ 1 KiB reserve each), 24 programs; 1-warp programs of 32
    # registers (1024 per warp: 64 by registers), 4 KiB shared (20 by shared memory): 20 = min(64, 48, 20, 24)
    ((8, 9), 1536, 102400, {0: 24, 4096: 20}),
    # an A10 (sm_86): the same but 16 programs
    ((8, 6), 1536, 102400, {0: 16, 4096: 16}),
    # a T4 (sm_75): 32 warps, 64 KiB, 16 programs, no runtime reserve: 4096 -> 16 by shared memory
    ((7, 5), 1024, 65536, {0: 16, 4096: 16}),
    # an H100 (sm_90): 64 warps, 228 KiB, 32 programs: 4096 + 1024 -> 45 by shared memory, 32 programs
    ((9, 0), 2048, 233472, {0: 32, 4096: 32}),
])
def test_multiprocessor_takes_the_programs_and_reserve_of_its_compute_capability(monkeypatch, capability, threads,
                                                                                 shared, want):
    props = SimpleNamespace(major=capability[0], minor=capability[1], regs_per_multiprocessor=65536,
                            max_threads_per_multi_processor=threads, shared_memory_per_multiprocessor=shared,
                            warp_size=32)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    sm = Multiprocessor.of(torch.device("cuda", 0))
    assert {s: resident_programs(32, s, 1, sm) for s in want} == want


def test_compiled_resources_loads_the_kernel_before_reading_its_registers():
    class Compiled:  # a Triton CompiledKernel's fields: registers are known once its module is loaded
        n_regs = n_spills = None
        metadata = SimpleNamespace(shared=4096, num_warps=2)

        @property
        def run(self):
            self.n_regs, self.n_spills = 168, 12
            return lambda *a: None

    assert occupancy.compiled_resources(Compiled()) == {"registers": 168, "spills": 12, "shared": 4096,
                                                        "num_warps": 2}


def test_whole_wave_splits_fill_one_wave_and_no_more(monkeypatch):
    monkeypatch.setattr(dec, "_processors", lambda device: 132)  # an H100/H200
    cuda = torch.device("cuda")
    # 4 programs of the folded 2-warp loop per multiprocessor: 528 at once
    assert dec.choose_splits(32, 8, cuda, num_warps=2) == 3  # the fixed rule: 768 programs, a wave and a half
    assert dec.choose_splits(32, 8, cuda, num_warps=2, resident=4) == 2  # 512 programs: one wave
    assert dec.choose_splits(1, 8, cuda, resident=4) == 66
    # 8 per multiprocessor (128 registers): 132 splits, capped
    assert dec.choose_splits(1, 8, cuda, resident=8) == dec.MAX_WAVE_SPLITS
    # more requests than a wave holds: one split each
    assert dec.choose_splits(128, 8, cuda, resident=4) == 1
    # never more splits than the longest context has pairs of blocks
    assert dec.choose_splits(1, 8, cuda, max_seq_len=1000, block_n=64, resident=4) == 8
    for batch in (1, 3, 32, 60):
        s = dec.choose_splits(batch, 8, cuda, resident=4)
        assert batch * 8 * s <= 4 * 132 or s == 1
        assert s == dec.MAX_WAVE_SPLITS or batch * 8 * (s + 1) > 4 * 132
