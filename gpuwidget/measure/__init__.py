"""Measuring the user's own workload: the DataLoader tuner and the batch-size probe run it and time it."""
