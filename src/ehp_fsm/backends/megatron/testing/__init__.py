"""Test support for the Megatron-Core backend (CPU compatibility layer). Not used in production."""
