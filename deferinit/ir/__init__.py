"""The IR and its analyses: the recorded graph, what a replay must run (plan), which writes it may skip (liveness, effects, regions, boxes); the interpreter that runs it is materialize/replay.py."""
