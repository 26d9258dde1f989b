"""The functional core: specs, world, guards, effects, engine step. No I/O, clock, randomness,
sockets or logging are imported here; time and ids arrive inside events."""
