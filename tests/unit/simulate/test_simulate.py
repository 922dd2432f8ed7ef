"""fxpipe.simulate on compiled pipes and plans: step time, timeline, memory, device models."""

import json
import re
import warnings

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.simulate.devices import NOMINAL, DeviceModel, device_model, parse_bytes
from fxpipe.simulate.eventsim import placement_map

# A device where a GEMM FLOP and an element take known times and nothing else costs anything.
UNIT = DeviceModel("unit", {"float32": 1e9}, memory_bandwidth=8e9, memory=1e12, link_bandwidth=1e9,
                   link_latency=0.0, efficiency={"gemm": 1.0, "conv": 1.0}, d_half={}, element_seconds=1e-9,
                   kernel_overhead=0.0, backward_overhead=0.0, action_overhead=0.0, nominal=False)


def _mlp(width=64, layers=4):
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def _pipe(model, x, n=2, **kw):
    return fxpipe.compile(model, n, example_inputs=(x,), devices=["cpu"] * n, **kw)


def test_a_step_of_linears_takes_its_flops_at_the_device_rate():
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4, checkpoint="never")
    sim = fxpipe.simulate(pipe, device=UNIT, runtime="local")
    flops = 4 * 3 * 2 * 32 * 64 * 64  # 4 linears, forward + 2 backward GEMMs (the first: weight only)
    flops -= 2 * 32 * 64 * 64  # the first linear's input needs no gradient
    loss = sim.costs[-1].loss * 4
    assert sim.step_time == pytest.approx(flops / 1e9 + loss, rel=1e-6)
    assert sim.bubble == pytest.approx(0.0)  # one device: no waiting


def test_an_exported_pipe_costs_its_convolutions_and_linears_as_the_fx_one_does():
    # export's ATen overloads are named 'conv2d.default': every conv and linear was costed as an elementwise
    # kernel, FLOPs x seconds per element (1084 ms against fx's 34 ms on the CPU model)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))
    x = torch.randn(4, 8, 8, 8)
    fx, exported = (fxpipe.simulate(_pipe(model, x, chunks=2, tracer=t), device="cpu").step_time
                    for t in ("fx", "export"))
    assert exported == pytest.approx(fx, rel=0.1)


def test_a_convolution_over_few_output_positions_runs_at_their_gemm_efficiency():
    # the efficiency followed input channels x kernel size only: ResNet's last 2x2 maps of a 1-row micro-batch
    # (4 output positions) were predicted at the plateau, 1.4 ms for 22 ms measured
    from fxpipe.simulate.nodetime import node_times
    knee = DeviceModel("knee", {"float32": 1e9}, memory_bandwidth=8e9, memory=1e12, link_bandwidth=1e9,
                       link_latency=0.0, efficiency={"gemm": 1.0, "conv": 1.0}, d_half={"conv": 64.0},
                       element_seconds=0.0, kernel_overhead=0.0, backward_overhead=0.0, action_overhead=0.0,
                       nominal=False)
    per_flop = []
    for size in (2, 16):
        x = torch.randn(1, 64, size, size)
        pipe = _pipe(nn.Sequential(nn.Conv2d(64, 64, 3, padding=1)), x, n=1, chunks=1)
        gm = pipe._gm  # the whole annotated graph
        node = next(n for n in gm.graph.nodes if n.op == "call_module")
        per_flop.append(node_times(gm, knee, 1.0, torch.float32)[node.name].forward / node.meta["fxpipe.flops"])
    assert per_flop[0] == pytest.approx(1e-9 * (4 + 64) / 4, rel=1e-6)  # d = 4 positions, not 576
    assert per_flop[1] == pytest.approx(1e-9 * (256 + 64) / 256, rel=1e-6)  # 256 positions, fewer than 576


def test_two_ranks_overlap_and_pay_the_link():
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4, checkpoint="never")
    local = fxpipe.simulate(pipe, device=UNIT, runtime="local")
    ranks = fxpipe.simulate(pipe, device=UNIT, runtime="distributed")
    assert ranks.step_time < local.step_time
    assert 0 < ranks.bubble < 0.5
    slow = fxpipe.simulate(pipe, device=UNIT.replace(link_latency=1e-3), runtime="distributed")
    assert slow.step_time >= ranks.step_time + 2e-3 - 1e-12  # at least the first send and the last gradient


def test_zero_bubble_moves_linear_weight_gradients_into_w():
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4)
    c = fxpipe.simulate(pipe, device=UNIT, schedule="zb").costs[1]
    assert c.weight == pytest.approx(c.forward, rel=0.05)  # dW = dyᵀx: one GEMM per linear, as its forward
    assert c.backward == pytest.approx(2 * c.forward, rel=0.05)


def test_checkpointing_adds_the_recomputation_and_cuts_memory():
    x = torch.randn(32, 64)
    wide = [nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64)]
    pipe = _pipe(nn.Sequential(*wide, *wide), x, chunks=4)
    never = fxpipe.simulate(pipe, device=UNIT, checkpoint="never", runtime="distributed")
    always = fxpipe.simulate(pipe, device=UNIT, checkpoint="always", runtime="distributed")
    redo = [4 * c.forward for c in never.costs]  # each rank recomputes its 4 forwards, partly overlapped
    assert never.step_time + max(redo) <= always.step_time <= never.step_time + sum(redo)
    for a, b in zip(always.stages, never.stages):
        assert a.memory.activations < b.memory.activations


def test_kept_bytes_are_what_autograd_saves_not_every_output():
    # Linear(64, 256) -> ReLU -> Linear(256, 64) as the last stage, micro-batch of 8 rows: autograd keeps
    # the input x (saved by the first linear; here the caller's batch, there before the step, so not
    # counted) and the ReLU's output (saved by it and the second linear), not the first linear's output;
    # the last stage keeps what its loss saves.
    x = torch.randn(32, 64)
    pipe = _pipe(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)), x, n=1, chunks=4)
    c = fxpipe.simulate(pipe, device=UNIT).costs[0]
    assert c.kept == 4 * 8 * 256 + 4 * 8 * 64  # and what the loss saves: as much as the output
    assert c.inputs == 0
    # W holds each deferred linear's input and output gradient: the second's alone, since the first
    # reads the caller's batch, which needs no gradient (the runtime then keeps its weight gradient in I)
    assert c.wstore == 4 * 8 * 256 + 4 * 8 * 64
    assert c.transient == 4 * 8 * (256 + 256)  # the ReLU's output gradient and its input's, at once
    # a later backward makes a linear's weight gradient apart before adding it in: the second's, beside its
    # output gradient and its input's, is the most
    assert c.transient + c.accumulate == 4 * 8 * (64 + 256) + (256 * 64 + 64) * 4
    # in I the second linear leaves its weight gradient to W (which makes it there): the first's counts
    assert c.transient + c.accumulate_i == 4 * 8 * 256 + (64 * 256 + 256) * 4
    assert c.grads_w == (256 * 64 + 64) * 4


def test_local_gpipe_runs_the_last_micro_batch_s_backward_first():
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4)
    sim = fxpipe.simulate(pipe, device=UNIT, runtime="local")
    backward = [s.action.mb for s in sim.spans if s.action.kind == "B" and s.action.stage == 0]
    assert backward == [3, 2, 1, 0]


def test_the_timeline_has_an_event_per_action_and_recomputation(tmp_path):
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4, checkpoint="except_last")
    tl = fxpipe.simulate(pipe, device="h100", schedule="zb").timeline()
    kinds = [e["cat"] for e in tl.events]
    assert kinds.count("forward") == 8 and kinds.count("backward") == 8 and kinds.count("weight") == 8
    assert kinds.count("recompute") == 6  # 3 checkpointed micro-batches x 2 stages
    tl.save(str(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_a_saved_plan_simulates_without_the_model(tmp_path):
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4)
    pipe.plan.save(str(tmp_path / "p.json"))
    sim = fxpipe.simulate(str(tmp_path / "p.json"), device="a100", schedule="1f1b", chunks=8)
    assert sim.chunks == 8 and sim.step_time > 0 and len(sim.stages) == 2
    assert "1f1b" in str(sim)


def test_a_saved_plan_predicts_the_example_batch_and_scales_to_another(tmp_path):
    # a plan (no graph) took batch=chunks for the example's and scaled nothing: 4x the batch, 4x the samples/s free
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4)
    pipe.plan.save(str(tmp_path / "p.json"))
    plan = str(tmp_path / "p.json")
    assert fxpipe.simulate(plan, device="a100").batch == 32
    small, big = (fxpipe.simulate(plan, device=UNIT, batch=b) for b in (32, 128))
    assert big.step_time > 2 * small.step_time
    assert big.stages[0].memory.activations > 2 * small.stages[0].memory.activations


def test_optimizer_state_and_bigger_batches_scale_memory():
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4)
    sim = fxpipe.simulate(pipe, device=UNIT, optimizer="adam", checkpoint="never")
    s = sim.stages[0].memory
    assert s.optimizer == 2 * s.grads == 2 * 2 * 64 * 64 * 4
    big = fxpipe.simulate(pipe, device=UNIT, optimizer="adam", checkpoint="never", batch=64)
    assert big.costs[0].kept == pytest.approx(2 * sim.costs[0].kept)
    a, b = sim.costs[0], big.costs[0]
    assert (b.transient + b.accumulate) - (a.transient + a.accumulate) == b.transient - a.transient  # weights: no
    assert big.stages[0].memory.activations > s.activations


def test_placements_map_stages_to_ranks():
    assert placement_map(None, 4, None) == [0, 1, 2, 3]
    assert placement_map("loop", 8, 4) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert placement_map("V", 8, 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="placement"):
        placement_map("zigzag", 4, 2)


def test_a_placement_a_schedule_s_lists_fix_otherwise_is_refused_not_ignored():
    # simulate(schedule="interleaved", placement="V") simulated the loop placement, silently
    from fxpipe.simulate.eventsim import schedule_rows

    assert schedule_rows("interleaved", 4, 4, "loop", 2)[2] == [0, 1, 0, 1]
    assert schedule_rows("zbv", 4, 4, [0, 1, 1, 0], 2)[2] == [0, 1, 1, 0]
    for schedule, placement in [("interleaved", "V"), ("zbv", "loop"), ("interleaved", [0, 0, 1, 1])]:
        told = re.escape(f"placement={placement!r} differs from where schedule='{schedule}''s action lists put")
        with pytest.raises(ValueError, match=told):
            schedule_rows(schedule, 4, 4, placement, 2)


def test_device_models():
    for name, model in NOMINAL.items():
        assert model.nominal and "nominal" in model.source and model.peak_flops["bfloat16"] > 1e14
    assert device_model("H100") is NOMINAL["h100"]
    assert NOMINAL["h200"].memory > NOMINAL["h100"].memory
    with pytest.raises(ValueError, match="use one of"):
        device_model("tpu")
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1GiB") == 2**30
    with pytest.raises(ValueError, match="reads as bits .* write 80GB"):  # read as 80 GB beside 400Gb/s's bits
        parse_bytes("80Gb")
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")
    # --memory 80 was taken as 80 bytes ("no configuration fits in 80B per device")
    with pytest.raises(ValueError, match="'80' has no unit, so it would be 80 bytes; write the unit, e.g. 80GB"):
        parse_bytes("80")
    assert parse_bytes("16000000000") == 16e9 and parse_bytes(80) == 80.0  # a byte count, a number given in Python


def test_cpu_model_is_calibrated_here():
    cpu = device_model("cpu")
    assert not cpu.nominal and cpu.peak_flops["float32"] > 1e8 and cpu.kernel_overhead > 0
    assert device_model("cpu") is cpu  # measured once per thread count


def test_simulate_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match="Pipe, a PipelinePlan"):
        fxpipe.simulate(nn.Linear(2, 2))
    pipe = _pipe(_mlp(), torch.randn(8, 64), chunks=4)
    for bad in ({"chunks": 0}, {"chunks": -2}, {"batch": 0}, {"chunks": 2.5}):  # chunks=0 simulated chunks=4
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.*use an integer of at least 1"):
            fxpipe.simulate(pipe, device=UNIT, **bad)
    with pytest.raises(ValueError, match="ranks=0; use an integer of at least 1"):
        fxpipe.simulate(pipe, device=UNIT, ranks=0)
    with pytest.raises(ValueError, match="dtype='bf17'; use a torch dtype"):
        fxpipe.simulate(pipe, device=UNIT, dtype="bf17")
    bare = fxpipe.compile(_mlp(), 2, chunks=2)  # a torch TypeError from inside the retain pass
    with pytest.raises(ValueError, match="compiled without example_inputs=, so its graph holds no shapes"):
        fxpipe.simulate(bare, batch=8)
    # data_parallel=0 was answered "predicts ranks ... pass runtime='distributed'"; a misspelt measured= node was
    # dropped, silently; shard=True over one replica was reported as sharded
    with pytest.raises(ValueError, match="data_parallel=0; give a whole number of ranks"):
        fxpipe.simulate(pipe, device=UNIT, data_parallel=0)
    with pytest.raises(ValueError, match="measured= names 'no_such_node', which no node of the graph is called"):
        fxpipe.simulate(pipe, device=UNIT, measured={"no_such_node": (1.0, 1.0)})
    with pytest.raises(ValueError, match="shard=True shards the replicas' state .* one replica"):
        fxpipe.simulate(pipe, device=UNIT, shard=True, runtime="distributed")


def test_a_dtype_is_taken_by_the_cli_s_names_too():
    pipe = _pipe(_mlp(), torch.randn(8, 64), chunks=4)
    named, typed = fxpipe.simulate(pipe, device="h100", dtype="bf16"), fxpipe.simulate(pipe, device="h100",
                                                                                       dtype=torch.bfloat16)
    assert named.step_time == typed.step_time < fxpipe.simulate(pipe, device="h100").step_time


def test_measured_true_times_the_nodes_here():
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4)
    sim = fxpipe.simulate(pipe, device=UNIT, measured=True)
    assert sim.costs[0].forward > 0 and sim.costs[0].forward != fxpipe.simulate(pipe, device=UNIT).costs[0].forward
    with pytest.raises(ValueError, match="pass the compiled Pipe"):
        fxpipe.simulate(pipe.plan, device=UNIT, measured=True)


def test_a_schedule_with_several_stages_per_rank_simulates_from_its_rows():
    # 4 stages looped over 2 ranks ("loop": stage s on rank s % 2), one micro-batch
    x = torch.randn(8, 64)
    pipe = _pipe(_mlp(layers=4), x, n=4, chunks=1)
    rows = "0F0 2F0 2B0 0B0\n1F0 3F0 3B0 1B0"
    sim = fxpipe.simulate(pipe, schedule=rows, device=UNIT, runtime="distributed")
    assert [s.rank for s in sim.stages] == [0, 1, 0, 1] and len(sim.devices) == 2
    one_each = fxpipe.simulate(pipe, schedule="gpipe", device=UNIT, runtime="distributed")
    assert sim.step_time == pytest.approx(one_each.step_time, rel=1e-9)  # m = 1: the same chain


def test_a_pipe_simulates_with_the_schedule_and_ranks_it_was_compiled_with():
    x = torch.randn(8, 64)
    looped = _pipe(_mlp(layers=6), x, n=6, chunks=4, schedule="interleaved", stages_per_rank=3)  # 2 ranks, not 3
    for obj in (looped, looped.plan):
        assert [s.rank for s in fxpipe.simulate(obj, device=UNIT, runtime="distributed").stages] == [0, 1] * 3
    rows = "0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1"
    own = _pipe(_mlp(), x, chunks=2, schedule=rows)
    assert fxpipe.simulate(own, device=UNIT).schedule == "custom"
    with pytest.raises(ValueError, match="compiled with your own schedule, .* pass them as schedule="):
        fxpipe.simulate(own.plan, device=UNIT)
    assert fxpipe.simulate(own.plan, device=UNIT, schedule=rows).schedule == "custom"


def test_an_odd_stage_count_under_interleaved_asks_for_the_ranks():
    pipe = _pipe(_mlp(layers=3), torch.randn(8, 64), n=3, chunks=4)  # n_stages / 2 ranks would put all 3 on one
    with pytest.raises(fxpipe.ScheduleError, match="places several of the 3 stages on each rank; .* ranks="):
        fxpipe.simulate(pipe, schedule="interleaved", device=UNIT)
    assert [s.rank for s in fxpipe.simulate(pipe, schedule="interleaved", ranks=3, device=UNIT).stages] == [0, 1, 2]


def test_a_schedule_putting_the_stages_on_other_ranks_than_the_pipe_s_says_so():
    # interleaved on a 2-stage pipe of 2 ranks simulated one rank holding both stages, silently
    pipe = _pipe(_mlp(layers=4), torch.randn(8, 64), n=2, chunks=4)
    with pytest.warns(UserWarning, match=r"simulated on 1 rank\(s\), but the pipe runs them on 2\. .* compile with "
                                         r"n_stages=4, stages_per_rank=2"):
        sim = fxpipe.simulate(pipe, schedule="interleaved", device=UNIT)
    assert [s.rank for s in sim.stages] == [0, 0]
    looped = _pipe(_mlp(layers=4), torch.randn(8, 64), n=4, chunks=4, schedule="interleaved", stages_per_rank=2)
    with pytest.warns(UserWarning, match=r"schedule='1f1b' puts one stage on each rank: the 4 stages are simulated on 4"):
        fxpipe.simulate(looped, schedule="1f1b", device=UNIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxpipe.simulate(pipe, schedule="zb", device=UNIT)
        fxpipe.simulate(looped, schedule="zbv", device=UNIT)
        fxpipe.simulate(pipe, schedule="interleaved", ranks=1, device=UNIT)  # asked for
        local = fxpipe.simulate(looped, schedule="1f1b")  # one process, as compiled: no ranks to differ
    assert local.runtime == "local"


def test_zbv_on_other_than_half_the_stages_names_the_ranks_to_give():
    pipe = _pipe(_mlp(layers=4), torch.randn(8, 64), n=4, chunks=4)
    with pytest.raises(fxpipe.ScheduleError, match=r"4 stages run on ranks=2, not ranks=4"):
        fxpipe.simulate(pipe, schedule="zbv", ranks=4, device=UNIT)
    assert [s.rank for s in fxpipe.simulate(pipe, schedule="zbv", ranks=2, device=UNIT).stages] == [0, 1, 1, 0]


def test_a_compiled_factor_scales_every_stage_s_work():
    x = torch.randn(32, 64)
    pipe = _pipe(_mlp(), x, chunks=4, schedule="zb", checkpoint="never")
    eager = fxpipe.simulate(pipe, device=UNIT)
    faster = fxpipe.simulate(pipe, device=UNIT, compiled=0.5)
    for a, b in zip(eager.costs, faster.costs):
        assert b.forward == pytest.approx(a.forward / 2) and b.weight == pytest.approx(a.weight / 2)
    assert faster.step_time < 0.55 * eager.step_time  # the work halves; the loss and messages stay
    with pytest.raises(ValueError, match="compiled=0; use a factor > 0"):
        fxpipe.simulate(pipe, device=UNIT, compiled=0)


def test_a_compiled_factor_measured_here():
    pipe = _pipe(_mlp(width=16, layers=2), torch.randn(8, 16), chunks=2)
    sim = fxpipe.simulate(pipe, device="cpu", compiled={"backend": "aot_eager"})
    assert sim.step_time > 0
    from fxpipe.simulate.compiledtime import compile_factor

    assert 0 < compile_factor(pipe._gm, 4, {"backend": "aot_eager"}, repeats=3) < 50


def test_tensor_parallel_divides_the_work_and_counts_its_collectives():
    """tensor_parallel=2: the plan's collectives per micro-batch on each stage, the sharded weights halved."""
    import tpmodels as tm

    torch.manual_seed(0)
    pipe = fxpipe.compile(tm.TiedDecoder(layers=4), 2, example_inputs=(torch.randint(0, 64, (8, 16)),), chunks=4,
                          schedule="1f1b")
    one = fxpipe.simulate(pipe, device="h100", runtime="distributed")
    two = fxpipe.simulate(pipe, device="h100", runtime="distributed", tensor_parallel=2)
    assert one.tp is None and two.tensor_parallel == 2 and len(two.tp) == 2
    # per micro-batch: 2 forward all-reduces per block (attention out, MLP out); the embedding's on stage 0;
    # the tied head's all-gather on the last
    assert sum(c.forward_count for c in two.tp) == 2 * 4 + 1 + 1
    assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in two.tp)
    for a, b in zip(one.stages, two.stages):
        assert 0.5 < b.memory.params / a.memory.params < 0.6  # norms and positions stay whole
    for a, b in zip(one.costs, two.costs):  # a rank's fresh weight gradients are of its shards
        assert b.accumulate == pytest.approx(a.accumulate * b.grads / a.grads)
    assert "tensor parallel over 2 ranks, collectives per micro-batch:" in str(two)
    with pytest.raises(ValueError, match="tensor_parallel=0"):
        fxpipe.simulate(pipe, device="h100", tensor_parallel=0)
    # in one process the replicas and tp were ignored, silently: the same step as without them
    with pytest.raises(ValueError, match="data_parallel=4, shard=True predict ranks.*runtime='distributed'"):
        fxpipe.simulate(pipe, device="h100", runtime="local", data_parallel=4, shard=True)


def test_a_tensor_parallel_plan_of_the_pipe_counts_the_bytes_the_automatic_one_does():
    """The plan records its collectives per micro-batch; simulating it divided them by the chunks a second time."""
    import tpmodels as tm

    from fxpipe.plan.tensorparallel import plan_tensor_parallel

    torch.manual_seed(0)
    pipe = fxpipe.compile(tm.TiedDecoder(layers=2), 2, example_inputs=(torch.randint(0, 64, (8, 16)),), chunks=4,
                          schedule="1f1b")
    auto = fxpipe.simulate(pipe, device="h100", runtime="distributed", tensor_parallel=2)
    pipe.plan.tensor_parallel = plan_tensor_parallel(pipe._gm, 2, "auto", record=False).record(4)  # as compile does
    own = fxpipe.simulate(pipe, device="h100", runtime="distributed")
    assert own.tensor_parallel == 2
    for a, b in zip(auto.tp, own.tp):
        assert b.forward_bytes == pytest.approx(a.forward_bytes, rel=0.01) and a.forward_bytes > 0
        assert b.backward_bytes == pytest.approx(a.backward_bytes, rel=0.01)


def test_chunks_past_the_batch_rows_are_told_and_batch_simulates_them():
    # chunks=16 on an example of 8 rows simulated 8 micro-batches, and said "chunks=8" only in its summary
    pipe = _pipe(_mlp(), torch.randn(8, 64), chunks=2)
    with pytest.warns(UserWarning, match=r"chunks=16 is more than the batch's 8 rows: simulating 8 micro-batches "
                                         r"of one row.*pass batch= \(at least 16 rows\)"):
        assert fxpipe.simulate(pipe, device=UNIT, chunks=16).chunks == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fxpipe.simulate(pipe, device=UNIT, chunks=16, batch=32).chunks == 16
