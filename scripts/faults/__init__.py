"""The parts of scripts/inject_faults.py: running processes (runner), the scenarios (scenarios, gtest_torchrun)."""
