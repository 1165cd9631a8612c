"""The orchestrator role: one aiohttp service per run that leases prompts to workers, ingests and
scores their rollouts, assembles groups and serves fresh batches to the trainer."""
