"""How many programs of a compiled kernel one GPU multiprocessor holds at once, and what that means for a grid.

A program (a CUDA block) stays resident on a multiprocessor until it ends, and
the multiprocessor takes new programs only while its registers, shared memory,
warp slots and program slots last (NVIDIA's occupancy rules, the CUDA
Occupancy Calculator's: registers are given to a warp in units of 256, the
runtime reserves 1 KiB of shared memory per program on sm_80 and later).  The
split decode's programs all do about the same work, so a grid of 1.5 waves
takes as long as 2: ``kernels/decode/triton_kernel.choose_splits`` can size the
grid to whole waves from :func:`resident_programs`.

The default INT2 decode loop compiles to 220-255 registers per thread on sm_90
(``python -m oscar_sglang.kernels.compile_check`` prints each launch's warps
per multiprocessor), which holds a multiprocessor to 8 of its 64 warps
whatever the program's warps: the kernel hides its memory latency with the few
warps it has (the folded loop since 2026-12-05: 12-16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Multiprocessor:
    """The per-multiprocessor limits that bound residency (defaults: sm_80/sm_90, an A100's or H100/H200's;
    :meth:`of` reads a device's)."""

    registers: int = 65536
    max_warps: int = 64
    shared_bytes: int = 233472  # sm_90: 228 KiB (sm_80: 164 KiB)
    max_programs: int = 32
    register_unit: int = 256  # registers are allocated to a warp in multiples of this
    shared_reserved: int = 1024  # per resident program, by the CUDA runtime (sm_80 and later)
    warp_size: int = 32

    @classmethod
    def of(cls, device: torch.device) -> "Multiprocessor":
        """The limits torch reports for a CUDA ``device`` (the defaults where a field is missing), with the
        programs per multiprocessor and the runtime's reserve of its compute capability, which torch does not
        report (:data:`MAX_PROGRAMS`)."""
        props = torch.cuda.get_device_properties(device)
        base = cls()
        warp = getattr(props, "warp_size", base.warp_size) or base.warp_size
        threads = getattr(props, "max_threads_per_multi_processor", 0)
        capability = (getattr(props, "major", 0), getattr(props, "minor", 0))
        return cls(registers=getattr(props, "regs_per_multiprocessor", 0) or base.registers,
                   max_warps=threads // warp if threads else base.max_warps,
                   shared_bytes=getattr(props, "shared_memory_per_multiprocessor", 0) or base.shared_bytes,
                   max_programs=MAX_PROGRAMS.get(capability, base.max_programs),
                   shared_reserved=0 if 0 < capability[0] < 8 else base.shared_reserved,
                   warp_size=warp)


# Resident programs per multiprocessor where it is not 32 (the CUDA C++ Programming Guide's table of technical
# specifications per compute capability): Turing, and the Ampere and Ada parts below the A100 (A10, A40, L4, L40S,
# RTX 30/40), which also hold 48 warps instead of 64 (torch reports that one).
MAX_PROGRAMS = {(7, 5): 16, (8, 6): 16, (8, 7): 16, (8, 9): 24}


def resident_programs(registers: int, shared_bytes: int, num_warps: int, sm: Multiprocessor = Multiprocessor()) -> int:
    """Programs of ``num_warps`` warps, each thread using ``registers`` registers and each program
    ``shared_bytes`` of shared memory, that one multiprocessor ``sm`` runs at once (0: the kernel cannot run)."""
    if registers < 0 or shared_bytes < 0 or num_warps < 1:
        raise ValueError(f"registers {registers}, shared {shared_bytes}, warps {num_warps}: expected >= 0, >= 0, >= 1")
    per_warp = -(-max(registers, 1) * sm.warp_size // sm.register_unit) * sm.register_unit
    by_registers = (sm.registers // per_warp) // num_warps
    by_warps = sm.max_warps // num_warps
    per_program = shared_bytes + sm.shared_reserved
    by_shared = sm.shared_bytes // per_program if per_program else sm.max_programs  # sm_75: no reserve
    return max(0, min(by_registers, by_warps, by_shared, sm.max_programs))


def compiled_resources(kernel) -> dict:
    """Registers per thread, spilled registers, shared bytes and warps of a Triton ``CompiledKernel``
    (what a launch or ``JITFunction.warmup`` returns on a GPU); loads it on its device if not yet loaded."""
    if hasattr(kernel, "result"):  # Triton's asynchronous compile mode hands out a future
        kernel = kernel.result()
    kernel.run  # noqa: B018  (the property loads the module: registers are known from then on)
    return {"registers": int(kernel.n_regs), "spills": int(kernel.n_spills), "shared": int(kernel.metadata.shared),
            "num_warps": int(kernel.metadata.num_warps)}
