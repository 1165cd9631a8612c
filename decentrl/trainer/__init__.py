"""The trainer role: FSDP2 ranks that pull batches, step, and publish the next version."""
