"""gpuwidget: see why the GPU waits while a notebook cell trains, and what to change."""
