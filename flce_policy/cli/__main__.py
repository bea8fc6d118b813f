"""``python -m flce_policy.cli``: the ``flce-policy`` command, without its console script."""

import sys

from flce_policy.cli.commands import main

sys.exit(main())
