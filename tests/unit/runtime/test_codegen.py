"""Code generation: the clock-cycle order, copies only across devices, values freed after use."""

import torch

import fxpipe
from fxpipe.plan.pipeline import PipelinePlan, SkipRoute, StagePlan
from fxpipe.runtime.codegen import clock_cycles, gpipe_source


def test_clock_cycles_pair_micro_batch_and_stage():
    m, n = 4, 3
    cycles = clock_cycles(m, n)
    assert len(cycles) == m + n - 1
    seen = [pair for clock in cycles for pair in clock]
    assert sorted(seen) == [(i, j) for i in range(m) for j in range(n)]
    for k, clock in enumerate(cycles):
        assert all(i + j == k for i, j in clock)


def _plan(devices):
    stages = [
        StagePlan(0, devices[0], ["x", "a"], ["x"], ["a", "x"]),
        StagePlan(1, devices[1], ["b"], ["a"], ["b"]),
        StagePlan(2, devices[2], ["c", "output"], ["b", "x"], []),
    ]
    return PipelinePlan(stages, [SkipRoute("x", 0, 2)], chunks=2, checkpoint="except_last")


def test_no_copies_on_one_device():
    src = gpipe_source(_plan(["cpu"] * 3), 2)
    assert "copy(" not in src.split("\n", 3)[3]


def test_copies_between_devices_and_skip_goes_direct():
    src = gpipe_source(_plan(["cuda:0", "cuda:1", "cuda:2"]), 2)
    assert "x_m0_to2, = copy(0, 2, 0, (x_m0,))" in src  # stage 0 -> stage 2, not through stage 1
    assert "a_m0_to1, = copy(0, 1, 0, (a_m0,))" in src
    assert "copy(1, 2, 0, (b_m0,))" in src


def test_values_deleted_after_last_use():
    src = gpipe_source(_plan(["cpu"] * 3), 2)
    lines = src.splitlines()
    # the skip x of micro-batch 0 lives until stage 2 has used it, then is deleted
    use = next(k for k, l in enumerate(lines) if "compute(2, 0" in l)
    assert "x_m0" in lines[use + 1] and lines[use + 1].strip().startswith("del")
    assert not any("x_m0" in l for l in lines[use + 2:])


def test_checkpoint_flags_follow_mode():
    src = gpipe_source(_plan(["cpu"] * 3), 2)
    assert "compute(0, 0, in0, True)" in src and "compute(0, 1, in0, False)" in src


def test_pipe_code_is_the_compiled_source():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 3))
    pipe = fxpipe.compile(model, 2, chunks=3, devices=["cpu"] * 2)
    assert pipe.code.startswith("def gpipe_2x3(rt, mb):")
    assert "# clock 3" in pipe.code and "# clock 4" not in pipe.code
