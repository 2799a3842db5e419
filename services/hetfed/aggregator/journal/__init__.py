"""The journal: a run's durable record in its state directory, and nothing else.

It owns the three files (``checkpoint.npz``, ``history.jsonl``, ``updates.wal``), their disk layer and crash
points, and the ``Journal`` a run holds: group commit of pushed updates, what is being made durable, and the
pending checkpoint of a round's close. It knows nothing of rounds' rules, gRPC or metrics.
"""
