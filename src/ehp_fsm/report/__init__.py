"""What a person sees of a run: the GPU-role timeline and (with `ehp-fsm run`) the progress
display and the final summary. Everything here reads the transition log or plain values; nothing
here changes the world."""
