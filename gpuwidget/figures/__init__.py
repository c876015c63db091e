"""A run's figures, below both the advisor and the child channel: the summary (loop, GPU, host), the
warm-up split, and the per-step pairing a rank's figures use.

``advice/`` judges these figures; ``children/`` computes them for a child's loop with the same
functions, so that a rank's steps are counted as the run's are. Nothing here imports ``advice/``,
``children/`` or a GPU vendor's source.
"""
