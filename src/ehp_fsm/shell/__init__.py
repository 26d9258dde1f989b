"""The shell around the pure core: one loop (`loop.Loop`) that owns the orchestrator and hands
each command to the one performer of its route."""
