"""asyncrl: asynchronous reinforcement learning for LLM reasoning models and agents.

Generation and training run side by side: inference engines produce rollouts tagged with the
policy version of every token, the trainer consumes them under a staleness bound and pushes new
weights back. See README.md for the two-command quick start.
"""

__version__ = "0.1.0"
