"""What wraps a stage's blocks from outside: data parallel (DDP, or FSDP2's sharding).

Models know nothing of parallelism; the pipeline runtime only interprets plans. Here a stage's
module is wrapped where it is built (train's layout, the check), the same way in both.
"""
