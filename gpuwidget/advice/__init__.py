"""The advisor: from a run's measurements to ranked findings with a change to make."""
