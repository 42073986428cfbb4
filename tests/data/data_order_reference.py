#!/usr/bin/env python3
"""fsdp::data's order (data/permutation.h) written again from docs/data.md, "The order", in Python.

    data_order_reference.py N SEED EPOCH   prints the order of [0, N): N indices, one line.

tests/data/test_data.cpp runs it and compares with the C++ one: two implementations of one
specification, so that neither can drift (and a user's own loader in another language can
reproduce the order).
"""
import sys

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
ROUNDS = 6


def mix64(z):
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def order(n, seed, epoch):
    bits = 2
    while (1 << bits) < n:
        bits += 2
    half = bits // 2
    mask = (1 << half) - 1
    s, e = mix64(seed), mix64(epoch + GOLDEN)
    keys = [mix64(s ^ ((e + r * GOLDEN) & M64)) for r in range(ROUNDS)]

    def encrypt(x):
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (mix64(right ^ k) & mask)
        return (left << half) | right

    out = []
    for i in range(n):
        x = encrypt(i)
        while x >= n:
            x = encrypt(x)
        out.append(x)
    return out


if __name__ == "__main__":
    n, seed, epoch = (int(v) for v in sys.argv[1:4])
    print(" ".join(str(v) for v in order(n, seed, epoch)))
