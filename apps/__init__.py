"""Applications on top of the stages and engines: CLI, demo, embedded pipeline, synthetic engine, oracle, tiny models."""
