"""The simulator and the planner: a plan's step time and memory, predicted without running it.

Reads a :class:`~fxpipe.plan.PipelinePlan`, its annotated graph and a schedule's action lists
(:mod:`fxpipe.runtime.schedules`); produces seconds and bytes per stage and micro-batch
(:mod:`~fxpipe.simulate.devices` device models, :mod:`~fxpipe.simulate.nodetime`,
:mod:`~fxpipe.simulate.stagecost`, :mod:`~fxpipe.simulate.measure`), the actions placed in time
(:mod:`~fxpipe.simulate.eventsim`), memory along that timeline (:mod:`~fxpipe.simulate.memsim`),
``fxpipe.simulate``'s :class:`Simulation` (:mod:`~fxpipe.simulate.simulation`), a layout's
replicas and network (:mod:`~fxpipe.simulate.network`, :mod:`~fxpipe.simulate.dpcost`), and the
searches ``fxpipe plan`` runs: one pipeline (:mod:`~fxpipe.simulate.planner`) or a whole cluster
(:mod:`~fxpipe.simulate.layouts`, :mod:`~fxpipe.simulate.cluster`).
"""
