"""``python -m gpuwidget -- python train.py``: the ``gpuwatch`` command, where its script is not on PATH."""

import sys

from gpuwidget.cli import main

sys.exit(main())
