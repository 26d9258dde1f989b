"""`ehp-fsm simulate`: the real controller at cluster scale in virtual time.

The real state-machine engine (`embedded.Orchestrator`, its transition log), the shell's one
loop (`shell.loop.Loop`), the planner (`core.planner.decide`), decision execution
(`run.decisions.Decisions`, `core.execution`) and the dispatcher (`rollout.dispatch.Dispatcher`)
run unchanged; only the far edge is simulated — host agents, engine processes, trainer ranks —
by performers that answer each command after a virtual delay drawn from the plan's `[simulate]`
cost model. No sockets, processes, threads or sleeping: time is a number that jumps to the next
event, and the same plan and seed give the same transition log, byte for byte.

Layout: `clock` (virtual time and the event queue), `cluster` (a plan scaled to N hosts),
`costs` (the cost model's draws), `edge` (the simulated agents, engines and trainer), `rollout`
(the run's dispatcher with simulated engines behind it), `watch` (invariants at every event,
deadlines, indices, GPU roles), `story` (the run: start, steps, planner, end), `output`
(summary, timeline, receipt, the `--ehp both` comparison), `hunt` (`--faults heavy` over many
seeds), `command` (the CLI's `simulate`), `calibrate` (the cost model fitted from a real run's
log).
"""
