"""Where the program runs, shared by training, inference, evaluation and export.

The device mesh and partitioning, multi-host start-up, storage (local or object store), Orbax checkpoints,
restoring a run's parameters, and the process settings of CPU runs.
"""
