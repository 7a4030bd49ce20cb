"""Train state, optimizer builders, the RL loop, checkpoints and metrics."""
