"""``fxpipe.simulate``: predict a pipeline's step time, bubble and per-stage memory before running it.

    pipe or plan ─▶ stage costs (FLOPs on a device model, or measured times) ─▶ per-action seconds
                 ─▶ the schedule's action lists placed in time (eventsim) ─▶ step time, timeline
                 ─▶ memory walked along the timeline (memsim) ─▶ per-stage peaks

The schedule is the same data the runtime runs (:mod:`fxpipe.runtime.schedules.builtin`, or your own
action lists), so any schedule simulates, including ones with several stages per rank
(placed as their action lists say). ``runtime="local"`` is one process: actions run clock by clock and stages
on the same device take turns; ``"distributed"`` is a rank per device, each running on as
soon as its inputs have arrived over the link.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from fxpipe.options import MULTI_STAGE_SCHEDULES, checkpoint_stop
from fxpipe.runtime.schedules.actions import Action
from fxpipe.runtime.schedules.finals import final_backwards
from fxpipe.simulate import eventsim, memsim
from fxpipe.simulate.compiledtime import check_factor, compile_factor
from fxpipe.simulate.devices import DeviceModel, device_model
from fxpipe.simulate.dpcost import (
    SMALL,
    gather_seconds,
    reduction_end,
    reduction_hold,
    sharded_memory,
    step_collectives,
)
from fxpipe.simulate.eventsim import Span
from fxpipe.simulate.measure import retain_anywhere
from fxpipe.simulate.network import Layout
from fxpipe.simulate.reading import (
    compiled_schedule,
    default_device,
    default_runtime,
    graph_and_plan,
    layout_of,
    local_devices,
)
from fxpipe.simulate.result import Simulation, StageResult
from fxpipe.simulate.stagecost import StageCost, describe, example_rows, graph_costs, plan_costs, under
from fxpipe.simulate.tpcost import TPCost, tp_record, with_tensor_parallel

__all__ = ["Simulation", "StageResult", "run", "simulate"]  # the first two from fxpipe.simulate.result

log = logging.getLogger(__name__)


def simulate(pipe_or_plan: Any, *, schedule: Any = None, chunks: int | None = None,
             checkpoint: str | Sequence[str] | None = None, device: str | DeviceModel | None = None,
             runtime: str | None = None, batch: int | None = None, optimizer: str = "none",
             dtype: torch.dtype | str | None = None, placement: str | Sequence[int] | None = None,
             ranks: int | None = None, measured: bool | dict[str, tuple[float, float]] | None = None,
             compiled: float | bool | dict[str, Any] | None = None, save: Any = None,
             tensor_parallel: int | None = None, data_parallel: int | None = None,
             shard: bool | None = None) -> Simulation:
    """Predict one training step of a compiled pipe (or a plan) without running it.

    ``schedule``, ``chunks`` and ``checkpoint`` default to the plan's (``checkpoint``: a mode, or
    one per stage; each stage's own policy by default); ``schedule`` also takes
    your own action lists, one per rank (:mod:`fxpipe.runtime.schedules.actions`). ``device`` is a
    device model: ``"a100"``, ``"h100"``, ``"h200"`` (nominal), ``"cpu"`` (this machine,
    calibrated on first use) or a :class:`~fxpipe.simulate.devices.DeviceModel`. ``runtime`` is
    ``"local"`` (one process: stages on one device take turns) or ``"distributed"`` (a rank
    per stage, or per ``placement``); the default follows the plan, and a plan made on CPUs
    simulated on an accelerator model runs a rank per stage. ``batch`` is the
    mini-batch in rows (default: the example batch). ``optimizer`` (``"sgd"``, ``"momentum"``,
    ``"adam"``) adds its state to the memory. ``measured`` maps node names to measured
    ``(forward, backward)`` seconds per micro-batch (:func:`fxpipe.simulate.measure.measure_nodes`), or
    is ``True`` to measure them now, on this machine (random inputs of the annotated shapes);
    other nodes come from the device model's FLOP rates. ``compiled`` scales every stage's
    forward and backward work for compiled stages (``torch_compile=``): a factor (compiled
    seconds per eager second, e.g. ``0.8``), or ``True`` (or a dict of torch.compile's
    arguments) to measure the factor now, on this machine, from the whole model's forward and
    backward, eager and compiled (:func:`fxpipe.simulate.compiledtime.compile_factor`).
    ``save`` is what selective recomputation keeps (default: the pipe's ``save=``, else the
    expensive nodes). ``tensor_parallel`` (default: the pipe's)
    splits every stage over that many ranks with the automatic plan (or the pipe's own plan at its
    size): the sharded work divided, the collectives counted per micro-batch (bytes and count, over
    the device's intra-node link, ``DeviceModel.tp_bandwidth``) and added to ``F`` and ``B``, the
    sharded weights divided (:mod:`fxpipe.simulate.tpcost`).

    The pipe's whole layout is followed (``runtime="distributed"``): its replicas
    (``data_parallel``, default the pipe's, each on ``batch`` rows of its own) and their gradient
    reduction, DDP's overlapped with each stage's last backward and holding its rank until done, or
    FSDP2's (``shard``, default the pipe's) gathers before the first forward and reduce-scatters after
    the last backward, the step's batch-size check and loss average over the replicas, its
    stages per rank and its tensor parallelism, placed on the device model's two-level network
    (:mod:`fxpipe.simulate.network`, :mod:`fxpipe.simulate.dpcost`). ``measured=True`` works on every
    rank of a distributed pipe: rank 0 times a copy of the whole model on plain tensors of the
    parameters' full shapes (other ranks hold only their own stages) and sends the times to all,
    so every rank predicts the same step; with ``device="cpu"`` the ranks also time their links
    (a ping-pong and an all-reduce, :mod:`fxpipe.simulate.linktime`) in place of the CPU model's,
    and how they share the cores on the model's own passes (:mod:`fxpipe.simulate.sharing`).
    """
    check_factor(compiled)
    dtype = _dtype(dtype)
    gm, plan = graph_and_plan(pipe_or_plan)
    if gm is not None and not any("fxpipe.value" in n.meta for n in gm.graph.nodes if n.op == "placeholder"):
        raise ValueError("this pipe was compiled without example_inputs=, so its graph holds no shapes or FLOPs to "
                         "predict from: compile it with example_inputs= (a batch of the inputs) to simulate it")
    if ranks is not None and (not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1):
        raise ValueError(f"ranks={ranks!r}; use an integer of at least 1 (or leave it out for the pipe's)")
    save = save if save is not None else getattr(pipe_or_plan, "_save", None)
    n = plan.n_stages
    for name, value in (("chunks", chunks), ("batch", batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}={value!r}; use an integer of at least 1 (or leave it out for the plan's)")
    given, chunks = chunks, chunks or plan.chunks
    name_ = device if device is not None else default_device(plan)
    if isinstance(name_, str) and name_.lower() == "cpu":  # across ranks: rank 0's calibration, on every rank
        from fxpipe.simulate.measure import agreed
        model = agreed(lambda: device_model(name_))
        if measured is True and gm is not None:  # and the links of this process group (every rank takes part)
            from fxpipe.simulate.linktime import measure_links
            model = measure_links(model)
    else:
        model = device_model(name_)
    runtime = runtime or default_runtime(plan, model)
    if runtime not in ("local", "distributed"):
        raise ValueError(f"runtime={runtime!r}; use 'local' (one process) or 'distributed' (a rank per stage)")
    for key, value in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key}={value!r}; give a whole number of ranks, 1 or more")
    asked = [f"{k}={v!r}" for k, v in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel))
             if v is not None and v != 1] + (["shard=True"] if shard else [])
    if runtime == "local" and asked:  # they were ignored, silently
        raise ValueError(f"{', '.join(asked)} predict{'s' if len(asked) == 1 else ''} ranks, which one process "
                         "does not have: pass runtime='distributed' as well")
    base = (example_rows(gm) if gm is not None else plan.example_rows) or batch or chunks
    batch = batch or base
    m = min(chunks, batch)
    if given is not None and given > batch:  # the step would run as many micro-batches: told as pipe.step tells it
        warnings.warn(f"chunks={given} is more than the batch's {batch} rows: simulating {m} micro-batches of one "
                      f"row, as a step of that batch runs; pass batch= (at least {given} rows) to simulate "
                      f"chunks={given}", stacklevel=2)
    if isinstance(measured, dict) and gm is not None:  # a misspelt node's time would be dropped, silently
        unknown = sorted(set(measured) - {n.name for n in gm.graph.nodes})
        if unknown:
            raise ValueError(f"measured= names {', '.join(map(repr, unknown[:4]))}, which no node of the graph is "
                             "called; name the nodes as pipe.gm.graph lists them (fxpipe inspect --code shows them)")
    if measured is True:
        if gm is None:
            raise ValueError("measured=True times the model's nodes; pass the compiled Pipe, not a plan")
        from fxpipe.simulate.measure import measure_everywhere
        rows = max(round(batch / m), 1)
        measured = measure_everywhere(gm, rows)
        if isinstance(name_, str) and name_.lower() == "cpu" and model.slots > 0:  # the ranks share these cores
            from fxpipe.simulate.sharing import measure_sharing
            share = measure_sharing(gm, rows)
            model = model.replace(slots=share) if share else model
    record, sharded = tp_record(gm, plan, tensor_parallel)
    layout = layout_of(plan, record, data_parallel, shard) if runtime == "distributed" else None
    if shard and layout is not None and layout.dp < 2:
        raise ValueError("shard=True shards the replicas' state (FSDP2), but there is one replica: give "
                         "data_parallel=2 or more with it")
    if layout is not None and layout.tp > 1:
        model = layout.tp_link(model)  # the tp group's collectives: inside a node if it fits
    tp: list[TPCost] | None = None
    if gm is not None:
        retain_anywhere(gm)
        costs = graph_costs(gm, plan, model, batch / m, dtype, measured or None, save)
        if record is not None:
            costs, tp = with_tensor_parallel(costs, gm, plan, record, model, batch / m, dtype, measured or None,
                                             sharded)
    else:
        if record is not None:
            raise ValueError("tensor_parallel= reads the model's graph; simulate the compiled Pipe, not a plan")
        costs = plan_costs(plan, model, m, batch / base, dtype or torch.float32)
    if compiled is not None:
        if compiled is True or isinstance(compiled, dict):
            if gm is None:
                raise ValueError("compiled=True times the model eager and compiled; pass the compiled Pipe, not a plan")
            compiled = compile_factor(gm, max(round(batch / m), 1), None if compiled is True else compiled)
        costs = [dataclasses.replace(c, forward=c.forward * compiled, backward=c.backward * compiled,
                                     weight=c.weight * compiled) for c in costs]
    if schedule is None:
        schedule = compiled_schedule(pipe_or_plan, plan)
    if ranks is None and placement is None and isinstance(schedule, str) and schedule == plan.schedule:
        world = 1 + max(s.on_rank for s in plan.stages)  # several stages per rank: as compiled
        ranks = world if world < n else None
    name, actions, rank_of = eventsim.schedule_rows(schedule, n, m, placement, ranks)
    if ranks is None and placement is None and name != "custom" and runtime != "local":  # one process: no ranks
        _say_other_ranks(schedule, plan, 1 + max(rank_of))
    if layout is not None and layout.dp > 1:  # as the runtime runs it: each stage's last backward a full B
        actions = final_backwards(actions)[0]
    device_of = local_devices(plan, model, rank_of) if runtime == "local" else rank_of
    if runtime == "local" and name == "gpipe":  # one process: autograd's backward, last micro-batch first
        actions = [[a for a in row if a.kind == "F"] + [a for a in reversed(row) if a.kind != "F"] for row in actions]
    policies = plan.policies() if checkpoint is None else checkpoint
    result = run(costs, actions, rank_of, device_of, model, name=name, checkpoint=policies,
                 runtime=runtime, batch=batch, optimizer=optimizer, layout=layout)
    if record is not None:
        result.tensor_parallel, result.tp = int(record["size"]), tp
    return result


def _say_other_ranks(schedule: str, plan: Any, simulated: int) -> None:
    """Warn when ``schedule`` puts the plan's stages on another number of ranks than the plan runs on."""
    world = 1 + max(s.on_rank for s in plan.stages)
    if simulated == world:
        return
    multi = schedule in MULTI_STAGE_SCHEDULES
    warnings.warn(
        f"schedule={schedule!r} puts {'two stages' if multi else 'one stage'} on each rank: the {plan.n_stages} "
        f"stages are simulated on {simulated} rank(s), but the pipe runs them on {world}. To compare schedules on "
        f"the same {world} rank(s), compile with n_stages={world * (2 if multi else 1)}"
        f"{', stages_per_rank=2' if multi else ''} and simulate that pipe; pass ranks= to simulate on another "
        "number of ranks on purpose", stacklevel=3)


def run(costs: list[StageCost], actions: list[list[Action]], rank_of: list[int], device_of: list[int],
        model: DeviceModel, *, name: str, checkpoint: str | Sequence[str], runtime: str, batch: int,
        optimizer: str = "none", layout: Layout | None = None) -> Simulation:
    """Simulate one step from stage costs and action lists per rank (what :func:`simulate` and the planner share).

    ``rank_of[j]`` is stage ``j``'s rank; ``device_of[j]`` its device (one process: stages on one
    device take turns, clock by clock). ``checkpoint`` is a mode, or one per stage. ``layout``
    places the pipeline among its replicas and tp groups on a two-level network
    (:mod:`fxpipe.simulate.network`): hops between nodes cross the slower link, the replicas'
    gradient reduction and FSDP2's gathers are added (:mod:`fxpipe.simulate.dpcost`); ``batch``
    is one replica's.
    """
    n = len(costs)
    m = 1 + max(a.mb for row in actions for a in row)
    policies = [checkpoint] * n if isinstance(checkpoint, str) else list(checkpoint)
    if len(policies) != n:
        raise ValueError(f"checkpoint= lists {len(policies)} modes for {n} stages; give one per stage")
    policies = ["never" if c.frozen else p for c, p in zip(costs, policies)]  # the runtime recomputes no frozen stage
    stop = [checkpoint_stop(p, m) for p in policies]
    costs = [under(c, p) for c, p in zip(costs, policies)]
    grid = layout if layout is not None else Layout(pp=1 + max(rank_of))
    grid = dataclasses.replace(grid, pp=1 + max(rank_of))
    gather = gather_seconds(costs, rank_of, grid, model)
    first_f = {j: min((a.mb for row in actions for a in row if a.stage == j and a.kind == "F"), default=0)
               for j in range(n)}
    feeds, reads = _links(costs)
    post = model.message_overhead if runtime == "distributed" else 0.0
    messages = {"F": [post * (len([p for p in feeds[j] if rank_of[p] != rank_of[j]])
                              + len([c for c in costs[j].sends if rank_of[c] != rank_of[j]])) for j in range(n)],
                "G": [post * (len([c for c in reads[j] if rank_of[c] != rank_of[j] and j in costs[c].grads_back])
                              + len([p for p in costs[j].grads_back if rank_of[p] != rank_of[j]])) for j in range(n)]}

    def duration(a: Action) -> float:
        """Return the seconds action ``a`` takes: its work, the runtime's and the messages it posts."""
        c = costs[a.stage]
        last = 0.5 * c.loss if a.stage == n - 1 else 0.0
        redo = (c.forward if a.mb < stop[a.stage] else c.recompute) if a.kind in ("B", "I") else 0.0
        work = {"F": c.forward + last, "B": c.backward + redo + last,
                "I": c.backward - c.weight + redo + last, "W": c.weight}[a.kind]
        talk = messages["F"][a.stage] if a.kind == "F" else messages["G"][a.stage] if a.is_backward else 0.0
        if a.kind == "F" and a.mb == first_f[a.stage]:
            talk += gather[a.stage]  # FSDP2: the stage's parameters gathered before its first forward
        return work + model.action_overhead + talk

    hops: dict[tuple[int, int, str], float] = {}

    def delay(src: int, dst: int, kind: str, mb: int) -> float:
        """Return the seconds a message from stage ``src`` to stage ``dst`` takes."""
        nbytes = costs[src].sends.get(dst, 0.0) if kind == "F" else costs[src].grads_back.get(dst, 0.0)
        if layout is None or runtime != "distributed":
            return model.message_seconds(nbytes)
        key = (src, dst, kind)
        if key not in hops:
            hops[key] = grid.hop_seconds(rank_of[src], rank_of[dst], nbytes, model)
        return hops[key]

    spans = eventsim.run(actions, duration, n_stages=n, rank_of=rank_of, delay=delay, feeds=feeds, reads=reads,
                         clocked=runtime == "local",
                         device_of=[device_of[_first_stage(row, r)] for r, row in enumerate(actions)],
                         slots=model.slots if runtime == "distributed" else 0.0, weight=grid.dp * grid.tp,
                         wake=model.wake_latency if runtime == "distributed" else 0.0,
                         hold=reduction_hold(actions, costs, rank_of, grid, model) if runtime == "distributed" else None)
    agree, average = step_collectives(grid, model, rank_of[0], rank_of[-1]) if runtime == "distributed" else (0.0, 0.0)
    begin = model.step_overhead + agree
    spans = [Span(s.action, s.rank, s.start + begin, s.end + begin) for s in spans]
    step = max((s.end for s in spans), default=0.0)
    if runtime == "distributed":
        step = max(step, reduction_end(spans, costs, rank_of, grid, model), _loss_told(spans, rank_of, grid, model,
                                                                                       average))
    if runtime == "distributed":  # what messages between ranks hold
        held = [dataclasses.replace(
            c, pinned_f=sum(b for k, b in c.sends.items() if rank_of[k] != rank_of[j]),
            pinned_b=sum(b for k, b in c.grads_back.items() if rank_of[k] != rank_of[j]),
            ahead_f=sum(costs[p].sends.get(j, 0.0) for p in feeds[j] if rank_of[p] != rank_of[j]),
            ahead_b=sum(costs[k].grads_back.get(j, 0.0) for k in reads[j] if rank_of[k] != rank_of[j]))
            for j, c in enumerate(costs)]
    else:  # one process: a value handed to a stage on the same device is the same tensor
        held = [dataclasses.replace(c, kept=c.kept - sum(
            costs[p].sends.get(j, 0.0) for p in feeds[j] if device_of[p] == device_of[j])) for j, c in enumerate(costs)]
    stage_mem, dev_mem = memsim.walk(spans, held, stop, device_of, optimizer,  # a value shared on a device once
                                     pooled=runtime == "distributed" and model.pooled_receives)
    stage_mem = [sharded_memory(mem, grid) for mem in stage_mem]
    dev_mem = {d: sharded_memory(mem, grid) for d, mem in dev_mem.items()}
    busy = [0.0] * n
    for s in spans:
        busy[s.action.stage] += s.end - s.start
    busy_dev = {d: 0.0 for d in set(device_of)}
    for j in range(n):
        busy_dev[device_of[j]] += busy[j]
    results = [StageResult(j, device_of[j], busy[j], step - busy_dev[device_of[j]], stage_mem[j]) for j in range(n)]
    bubble = 1 - sum(busy_dev.values()) / (len(busy_dev) * step) if step else 0.0
    return Simulation(step, bubble, results, dev_mem, spans, name, m, describe(policies), runtime, model, costs,
                      batch, policies, grid.tp, None, grid.dp, grid.shard)


def _loss_told(spans: list[Span], rank_of: list[int], grid: Layout, model: DeviceModel, average: float) -> float:
    """Return when every rank has the step's loss: the last stage's rank averages it over the replicas, then
    sends it to the other ranks of its pipeline (a small message, to ranks that wait for it)."""
    ends = [s.end for s in spans if s.rank == rank_of[-1]]
    if not ends:
        return 0.0
    told = max(ends) + average
    if len(set(rank_of)) > 1:
        told += grid.hop_seconds(rank_of[-1], rank_of[0], SMALL, model) + model.wake_latency
    return told


def _first_stage(row: list[Action], r: int) -> int:
    """Return the stage of a rank's first action (the rank's own index if it has none)."""
    return row[0].stage if row else r


def _links(costs: list[StageCost]) -> tuple[list[list[int]], list[list[int]]]:
    """Return, per stage, the stages it receives values from and the stages it sends values to."""
    n = len(costs)
    reads = [sorted(c.sends) for c in costs]
    feeds: list[list[int]] = [[] for _ in range(n)]
    for j, targets in enumerate(reads):
        for t in targets:
            feeds[t].append(j)
    for j in range(1, n):  # a stage fed by nobody (no tensors cross) still waits for the one before
        if not feeds[j]:
            feeds[j].append(j - 1)
            reads[j - 1].append(j)
    return feeds, reads


_DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


def _dtype(value: Any) -> torch.dtype | None:
    """Return ``value`` as a torch dtype: one, or a name as the CLI's ``--dtype`` takes (``"bf16"``)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ValueError(f"dtype={value!r}; use a torch dtype (torch.bfloat16) or one of {sorted(_DTYPE_NAMES)}")
