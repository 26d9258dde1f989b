"""ehp-fsm."""
