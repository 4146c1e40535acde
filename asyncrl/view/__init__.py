"""`asyncrl view`: a local web page of runs (curves, events, trajectories token by token)."""
