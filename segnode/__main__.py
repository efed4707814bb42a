"""``python -m segnode``: the ``segnode`` command (:func:`segnode.node.ops.cli.main`)."""

import sys

from segnode.node.ops.cli import main

sys.exit(main())
