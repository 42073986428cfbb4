#!/usr/bin/env python3
"""libtorch_fsdp.so's counting allocator, loaded into Python with ctypes after `import torch`, counts
the tensors Python allocates, to the byte (how fsdp_bench measures PyTorch's FSDP2 like our runs).

  python tests/fsdp/check_counting_in_python.py build/fsdp/libtorch_fsdp.so
"""
import ctypes
import sys

import torch

lib = ctypes.CDLL(sys.argv[1])
lib.fsdp_memory_cpu_current_bytes.restype = ctypes.c_int64
lib.fsdp_memory_cpu_peak_bytes.restype = ctypes.c_int64
if lib.fsdp_memory_cpu_current_bytes() != -1:
    sys.exit("FAILED: counting reported as on before it was enabled")
lib.fsdp_memory_enable_cpu_counting()
base = lib.fsdp_memory_cpu_current_bytes()
x = torch.empty(1_000_000, dtype=torch.float32)
y = torch.empty(250_000, dtype=torch.float64)
now = lib.fsdp_memory_cpu_current_bytes()
if now - base != 6_000_000:
    sys.exit(f"FAILED: two tensors of 4,000,000 and 2,000,000 bytes counted as {now - base}")
lib.fsdp_memory_reset_cpu_peak()
del x
z = torch.ones(100, 100)  # 40,000 bytes, allocated after x was freed
peak, after = lib.fsdp_memory_cpu_peak_bytes(), lib.fsdp_memory_cpu_current_bytes()
if peak != now or after != now - 4_000_000 + 40_000:
    sys.exit(f"FAILED: peak {peak} (want {now}), current {after} (want {now - 4_000_000 + 40_000})")
print("OK: Python's tensors counted to the byte:", now - base, "bytes, peak", peak - base)
