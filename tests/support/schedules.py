"""Schedules of the tests' own, as text."""

CUSTOM = """
# stage 0: warm up, then input gradients as soon as possible, weights at the end
0F0 0F1 0I0 0F2 0I1 0I2 0W0 0W1 0W2
1F0 1B0 1F1 1B1 1F2 1B2   # stage 1: one forward, one backward
"""
