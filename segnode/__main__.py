"""``python -m segnode``: the ``segnode`` command (:func:`segnode.node.cli.main`)."""

import sys

from segnode.node.cli import main

sys.exit(main())
