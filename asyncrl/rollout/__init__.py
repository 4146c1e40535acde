"""Producer side of asynchronous RL: staleness control, the workflow executor, workflows."""
