"""Jobs that wire concrete components together (the only layer that knows all of them)."""
