"""The training-step planner: one step of a model measured by PyTorch's own trackers."""
