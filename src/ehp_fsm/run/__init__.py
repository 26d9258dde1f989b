"""`ehp-fsm run PLAN`: one EHP GRPO job, end to end (see `job`)."""
