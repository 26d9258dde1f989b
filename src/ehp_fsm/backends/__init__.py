"""Training backends: adapters that run a replica's forward/backward and optimizer step.

`ehp_fsm.backends.megatron` runs Megatron-Core (GPTModel, DDP, DistributedOptimizer). Backends are
thin: ordering, membership and guards live in the state machines, not here. Importing this
package imports no backend; import the sub-package you need (Megatron-Core is an optional extra).
"""
