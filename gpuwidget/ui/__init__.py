"""What the user sees: the live plot, the post-run report."""
